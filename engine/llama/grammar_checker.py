"""The front end's grammar check (:func:`engine.llama.grammar.check`) in a child process, bounded
in time.

llguidance bounds compiling a grammar (:data:`engine.llama.grammar.LIMITS`) but not all of its
validation: a JSON schema of one string whose ``allOf`` holds ``pattern`` regexes makes it decide
whether their intersection is empty, which grows exponentially with their number (about 1 KiB of
schema, 22 patterns: 12.5 s and 1 GB before the refusal; 60 patterns: minutes). Run in the
request's thread, one such request held a worker's CPU and memory that long. In a child
process, a check that outlasts :data:`CHECK_TIMEOUT_S` is refused and the child killed.

The child is ``python -m engine.llama.grammar_checker``: one JSON line ``[grammar, text_only]``
in, one JSON line (the verdict) out. A fresh interpreter, not a fork of a threaded worker.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
import threading

#: Seconds one grammar's check may take (a client's schema or regex takes milliseconds).
CHECK_TIMEOUT_S = 5.0
#: The verdict on a grammar whose check took longer (``{}``: the seconds), or killed its child.
TOO_SLOW = "llguidance could not check it within {:g} s; simplify it"


class GrammarChecker:
    """:func:`engine.llama.grammar.check` in one child process (started at the first check: about
    0.5 s), one check at a time, each given ``timeout_s`` from its start; over it, or if the
    child dies, the verdict is :data:`TOO_SLOW` and the next check starts a new child. The child
    exits when its parent does (its stdin closes), so there is nothing to close. Thread-safe."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def check(self, grammar: str, text_only: bool = False) -> str:
        """The verdict: "" when ``grammar`` compiles within llguidance's limits, else why not."""
        with self._lock:  # one at a time, so no check's time counts another's wait
            if self._child is None:
                self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, text=True)
            try:
                self._child.stdin.write(json.dumps([grammar, text_only]) + "\n")
                self._child.stdin.flush()
                answered, _, _ = select.select([self._child.stdout], [], [], self.timeout_s)
                line = self._child.stdout.readline() if answered else ""
            except OSError:  # the child died
                line = ""
            if not line:
                self._child.kill()
                self._child.wait()
                self._child = None
                return TOO_SLOW.format(self.timeout_s)
            return json.loads(line)


def main() -> None:
    """The child: answer each line of stdin until it closes (the parent exited or gave up on it)."""
    from engine.llama.grammar import check  # here: that module imports this one

    for line in sys.stdin:
        grammar, text_only = json.loads(line)
        print(json.dumps(check(grammar, text_only)), flush=True)


if __name__ == "__main__":
    main()
