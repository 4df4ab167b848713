"""The front end's check of a request's grammar: whether llguidance can compile it within
:data:`engine.grammar_limits.LIMITS` and whether any text is an instance of it, so that the
engine never receives one that fails, and a fault is refused naming the client's field.

- :func:`check`: one grammar (a structured output alone).
- :func:`check_schemas`: the JSON schemas of a tool-calling request (its format's and each
  callable function's arguments), in one llguidance build: a probe grammar with one tagged
  alternative per schema, walked one step into each. A fault is attributed to its schema by
  checking them one by one, which only a refused request pays.
- :class:`GrammarChecker`: either, in child processes (``python -m
  server.structured.check_child``), bounded in time. llguidance bounds compiling but not all
  of its validation: a string schema whose ``allOf`` holds ``pattern`` regexes makes it
  intersect them, which grows exponentially with their number (about 1 KiB of schema, 22
  patterns: 12.5 s and 1 GB). In a child (at most :data:`CHILDREN`), a check that outlasts
  :data:`CHECK_TIMEOUT_S` is refused and the child killed; a check that finds every child busy
  that long is a 503 (:class:`ChecksBusy`).
- :class:`CheckedGrammars`: the verdicts, memoized per tenant.

Checks need no model: they build over llguidance's byte tokenizer.
"""
from __future__ import annotations

import functools
import json
import math
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import llguidance

from engine.errors import Saturated
from engine.grammar_limits import limits

#: Seconds one check may take (a client's schema or regex takes milliseconds).
CHECK_TIMEOUT_S = 5.0
#: Child processes one front end checks in at once: a costly schema (seconds, up to a gigabyte)
#: holds one, and a check waits at most a check's time for one to be free.
CHILDREN = 2
#: The verdict on a grammar whose check took longer (``{}``: the seconds), or killed its child.
TOO_SLOW = "llguidance could not check it within {:g} s; simplify it"
#: The verdict on a grammar or schema that compiles but that no text is an instance of.
NO_INSTANCE = "no text is an instance of it"
#: The child's module (``python -m``).
CHILD = "server.structured.check_child"


class ChecksBusy(Saturated):
    """Every grammar checker of this front end stayed busy for a whole check's time (other
    requests' costly schemas): the server's state, not the client's grammar, so a 503 with
    ``retry_after`` (seconds) and no verdict kept."""

    message = "every grammar checker is busy with other requests' schemas; retry"


def check(grammar: str, text_only: bool = False) -> str:
    """Whether llguidance can compile ``grammar`` within :data:`engine.grammar_limits.LIMITS`:
    "" if so, else the library's message (a bad schema, regex or Lark, an unimplemented
    JSON-schema keyword, a grammar over the limits).

    ``text_only``: the grammar names no special token (a client's structured output), so it is
    also taken one step over bytes: one with no first step, as a schema or regex with no
    instance at all (``{"$ref": "#"}``, ``[^\\s\\S]``), is :data:`NO_INSTANCE`."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=limits())
        if error or not text_only:
            return error
        matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=limits())
        if matcher.is_error():  # it names what bytes cannot stand for (a special token): the engine decides
            return ""
        matcher.compute_logit_bias()
        return NO_INSTANCE if matcher.is_error() else ""
    except (ValueError, TypeError) as e:  # not a grammar at all (a corrupt record)
        return str(e) or "invalid grammar"


def check_schemas(schemas: list[dict]) -> tuple[int, str]:
    """The first of ``schemas`` (JSON schemas, their ``x-guidance`` options included) that
    llguidance cannot compile or that no text is an instance of, and why: ``(index, message)``,
    ``(-1, "")`` when all pass, ``(-1, message)`` when they fail only together (over the
    limits). As :func:`check` of each one's grammar with ``text_only``, in one build."""
    tags = [f"{i}:" for i in range(len(schemas))]  # distinct, none a prefix of another
    lark = "%llguidance {}\nstart: " + " | ".join(f'"{t}" s{i}' for i, t in enumerate(tags)) + "\n" + \
        "".join(f"s{i}: %json {json.dumps(s)}\n" for i, s in enumerate(schemas))
    try:
        probe = llguidance.LLMatcher(_byte_tokenizer(), llguidance.grammar_from("lark", lark), log_level=0,
                                     limits=limits())
    except (ValueError, TypeError) as e:
        return -1, str(e) or "invalid grammar"
    if probe.is_error():  # a schema llguidance refuses: which one, and its own message
        for i, schema in enumerate(schemas):
            error = check(llguidance.grammar_from("json_schema", json.dumps(schema)), text_only=True)
            if error:
                return i, error
        return -1, probe.get_error()
    for i, tag in enumerate(tags):  # one step into each: a schema with no instance leaves none
        walk = probe.deep_copy()
        walk.consume_tokens(list(tag.encode()))
        walk.compute_logit_bias()
        if walk.is_error():
            return i, NO_INSTANCE
    return -1, ""


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer("byte")


class GrammarChecker:
    """:func:`check` and :func:`check_schemas` in child processes (each started when a check
    finds none idle and fewer than ``children`` running: about 0.5 s), one check at a time each,
    each given ``timeout_s`` from its start; over it, or if the child dies, the verdict is
    :data:`TOO_SLOW` and that child is killed. A check waits at most ``wait_s`` (default
    ``timeout_s``) for a free child, then raises :class:`ChecksBusy` (others' slow schemas held
    them all). A child exits when its parent does (its stdin closes), so there is nothing to
    close. Thread-safe.

    The protocol: one JSON line ``["grammar", grammar, text_only]`` or ``["schemas", schemas]``
    in, one JSON line (the verdict) out."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S, children: int = CHILDREN, wait_s: float | None = None):
        self.timeout_s, self.children = timeout_s, children
        self.wait_s = timeout_s if wait_s is None else wait_s
        self._idle: list[subprocess.Popen] = []
        self._running = 0  # children started and not killed, idle or checking
        self._free = threading.Condition()

    def check(self, grammar: str, text_only: bool = False) -> str:
        """:func:`check`'s verdict, or :data:`TOO_SLOW`.

        Raises:
            ChecksBusy: no child was free within ``wait_s``.
        """
        verdict = self._ask(["grammar", grammar, text_only])
        return TOO_SLOW.format(self.timeout_s) if verdict is None else verdict

    def check_schemas(self, schemas: list[dict]) -> tuple[int, str]:
        """:func:`check_schemas`' verdict; over the time, the one schema's :data:`TOO_SLOW`, or,
        of several, the first one that is too slow alone (each then checked in its own time:
        only a refused request pays it).

        Raises:
            ChecksBusy: no child was free within ``wait_s``.
        """
        verdict = self._ask(["schemas", schemas])
        if verdict is not None:
            return tuple(verdict)
        if len(schemas) > 1:
            for i, schema in enumerate(schemas):
                if self._ask(["schemas", [schema]]) is None:
                    return i, TOO_SLOW.format(self.timeout_s)
        return (0 if len(schemas) == 1 else -1), TOO_SLOW.format(self.timeout_s)

    def _ask(self, question: list):
        """The child's answer to ``question`` (None: it took over ``timeout_s``, or died)."""
        child, line = self._take(), ""
        try:
            child.stdin.write(json.dumps(question) + "\n")
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
        return json.loads(line) if line else None

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
            return subprocess.Popen([sys.executable, "-m", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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


class CheckedGrammars:
    """A front end's memo of a :class:`GrammarChecker`'s verdicts: the last ``capacity``, per
    tenant and question, so a tenant's repeated schema costs a dictionary lookup (and no tenant
    learns from a response's time which grammars another used). Thread-safe.

    Args:
        checker: what answers (a :class:`GrammarChecker` by default; anything with its
            ``check`` and ``check_schemas``).
    """

    def __init__(self, capacity: int = 256, checker=None):
        self.capacity, self.checker = capacity, checker or GrammarChecker()
        self._verdicts: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, tenant: int, grammar: str, text_only: bool = False) -> str:
        """:func:`check`'s answer for ``tenant``'s ``grammar``."""
        return self._memo((tenant, grammar, text_only), lambda: self.checker.check(grammar, text_only))

    def check_schemas(self, tenant: int, schemas: list[dict]) -> tuple[int, str]:
        """:func:`check_schemas`' answer for ``tenant``'s ``schemas``."""
        key = (tenant, "schemas", json.dumps(schemas))
        return self._memo(key, lambda: self.checker.check_schemas(schemas))

    def _memo(self, key: tuple, ask):
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
                return verdict
        verdict = ask()  # outside the lock: cached checks do not wait
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.capacity:
                self._verdicts.popitem(last=False)
        return verdict
