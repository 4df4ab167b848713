"""The front end's grammar check (:func:`engine.llama.grammar.check`) in a child process, bounded
in time.

llguidance bounds compiling a grammar (:data:`engine.llama.grammar.LIMITS`) but not all of its
validation: a JSON schema of one string whose ``allOf`` holds ``pattern`` regexes makes it decide
whether their intersection is empty, which grows exponentially with their number (about 1 KiB of
schema, 22 patterns: 12.5 s and 1 GB before the refusal; 60 patterns: minutes). Run in the
request's thread, one such request held a worker's CPU and memory that long. In a child
process (at most :data:`CHILDREN` of them), a check that outlasts :data:`CHECK_TIMEOUT_S` is
refused and the child killed; a check that finds every child busy that long is a 503.

The child is ``python -m engine.llama.grammar_checker``: one JSON line ``[grammar, text_only]``
in, one JSON line (the verdict) out. A fresh interpreter, not a fork of a threaded worker.
"""
from __future__ import annotations

import json
import math
import select
import subprocess
import sys
import threading
import time

from engine.errors import ChecksBusy

#: Seconds one grammar's check may take (a client's schema or regex takes milliseconds).
CHECK_TIMEOUT_S = 5.0
#: Child processes one front end checks in at once: a costly schema (seconds, up to a gigabyte)
#: holds one, and a check waits at most a check's time for one to be free.
CHILDREN = 2
#: The verdict on a grammar whose check took longer (``{}``: the seconds), or killed its child.
TOO_SLOW = "llguidance could not check it within {:g} s; simplify it"


class GrammarChecker:
    """:func:`engine.llama.grammar.check` in child processes (each started when a check finds none
    idle and fewer than ``children`` running: about 0.5 s), one check at a time each, each check
    given ``timeout_s`` from its start; over it, or if the child dies, the verdict is
    :data:`TOO_SLOW` and that child is killed. A check waits at most ``wait_s`` (default
    ``timeout_s``) for a free child, then raises :class:`engine.errors.ChecksBusy` (others' slow
    schemas held them all; a hostile helper's 10 at once held one child for 50 s). A child exits
    when its parent does (its stdin closes), so there is nothing to close. Thread-safe."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S, children: int = CHILDREN, wait_s: float | None = None):
        self.timeout_s, self.children = timeout_s, children
        self.wait_s = timeout_s if wait_s is None else wait_s
        self._idle: list[subprocess.Popen] = []
        self._running = 0  # children started and not killed, idle or checking
        self._free = threading.Condition()

    def check(self, grammar: str, text_only: bool = False) -> str:
        """The verdict: "" when ``grammar`` compiles within llguidance's limits, else why not.

        Raises:
            ChecksBusy: no child was free within ``wait_s``.
        """
        child, line = self._take(), ""
        try:
            child.stdin.write(json.dumps([grammar, text_only]) + "\n")
            child.stdin.flush()
            answered, _, _ = select.select([child.stdout], [], [], self.timeout_s)
            line = child.stdout.readline() if answered else ""
        except OSError:  # the child died
            pass
        finally:  # whatever happened, the child is given back or killed: a lost one is never counted
            if not line:
                child.kill()
                child.wait()
            self._give(child if line else None)
        return json.loads(line) if line else TOO_SLOW.format(self.timeout_s)

    def _take(self) -> subprocess.Popen:
        deadline = time.monotonic() + self.wait_s
        with self._free:
            while not self._idle and self._running >= self.children:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChecksBusy(math.ceil(self.timeout_s))  # a child is free by then
                self._free.wait(left)
            if self._idle:
                return self._idle.pop()
            self._running += 1
        try:  # outside the lock: a start takes half a second
            return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True)
        except BaseException:
            self._give(None)
            raise

    def _give(self, child: subprocess.Popen | None) -> None:
        """Return ``child`` to the idle ones (None: it is gone) and wake a waiting check."""
        with self._free:
            if child is None:
                self._running -= 1
            else:
                self._idle.append(child)
            self._free.notify()


def main() -> None:
    """The child: answer each line of stdin until it closes (the parent exited or gave up on it)."""
    from engine.llama.grammar import check  # here: that module imports this one

    for line in sys.stdin:
        grammar, text_only = json.loads(line)
        print(json.dumps(check(grammar, text_only)), flush=True)


if __name__ == "__main__":
    main()
