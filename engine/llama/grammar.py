"""Grammar constraints with llguidance: what a constrained sequence may generate next.

A constraint is an llguidance grammar (its JSON form: ``{"grammars": [...]}`` holding Lark, a
JSON schema or a regex; made by ``llguidance.grammar_from`` or ``LLMatcher.grammar_from_*``),
carried on the request as ``SamplingParams.grammar``. The front end checks it with
:func:`check` (no tokenizer needed) and refuses a bad one; the engine compiles it into an
``LLMatcher`` over the model's vocabulary (:class:`Grammars`, on a thread of its own and cached
per tenant), and each sequence walks its own copy (:class:`GrammarConstraint`), which
``engine/llama/sampler.py`` consults as llama.cpp's ``common_sampler`` consults its grammar:
the chain's token first, the allowed tokens only when it is refused.

Limits (docs/api.md "Structured outputs"): the grammar must fit the request's variable section
(``--max-request-extras-bytes``, 32 KiB by default), and compiling it is bounded by
:data:`LIMITS` (llguidance's fuel and size limits; a grammar over them is refused by
:func:`check` with the library's message). Compiling never runs on the step loop's thread.
"""
from __future__ import annotations

import ctypes
import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llama_cpp
import llguidance
import numpy as np

from engine.llama.grammar_checker import GrammarChecker

#: llguidance's parser limits, the same in the front end's check and the engine's compile.
#: ``initial_lexer_fuel`` bounds the lexer's construction (about 50k units a millisecond, so at
#: most about 20 ms), ``max_grammar_size`` the grammar's symbols, ``step_lexer_fuel`` and
#: ``step_max_items`` one mask (about 14k and 20k units a millisecond: at most about 7 ms).
LIMITS = dict(initial_lexer_fuel=1_000_000, max_grammar_size=200_000, step_lexer_fuel=100_000,
              step_max_items=50_000, verbose_errors=False)
#: Compiled grammars the engine keeps (each entry one tenant's grammar; least recently used evicted).
CACHE_ENTRIES = 64


_BIT = np.arange(32)
#: Masks with more non-zero 32-token words than this are unpacked whole (cheaper then).
SPARSE_WORDS = 128


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def check(grammar: str, text_only: bool = False) -> str:
    """Whether llguidance can compile ``grammar`` within :data:`LIMITS`: "" if so, else the
    library's message (a bad schema, regex or Lark, an unimplemented JSON-schema keyword, a
    grammar over the limits).

    ``text_only``: the grammar names no special token (a client's structured output), so it is
    also taken one step over bytes (llguidance's byte tokenizer): one with no first step, as a
    schema or regex with no instance at all (``{"$ref": "#"}``, ``[^\\s\\S]``), is refused here,
    naming the client's field, rather than by the engine's first mask."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=limits())
        if error or not text_only:
            return error
        matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=limits())
        if matcher.is_error():  # it names what bytes cannot stand for (a special token): the engine decides
            return ""
        matcher.compute_logit_bias()
        return "no text is an instance of it" if matcher.is_error() else ""
    except (ValueError, TypeError) as e:  # not a grammar at all (a corrupt record)
        return str(e) or "invalid grammar"


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer("byte")


def json_schema_of(grammar: str) -> dict | None:
    """The JSON schema (with its ``x-guidance`` options) of a grammar that is one JSON schema
    alone (llguidance's JSON form, as ``LLMatcher.grammar_from_json_schema`` writes it), else
    None (a regex, a choice, Lark, several grammars)."""
    try:
        grammars = json.loads(grammar).get("grammars")
    except (ValueError, AttributeError):
        return None
    if not isinstance(grammars, list) or len(grammars) != 1 or not isinstance(grammars[0], dict):
        return None
    schema = grammars[0].get("json_schema")
    return schema if isinstance(schema, dict) and not grammars[0].get("lark_grammar") else None


#: JSON Schema (2020-12) keywords whose value is a schema, a list of schemas, or an object of
#: schemas; any other keyword's value is data (``const``, ``enum``, ``default``...) or a number.
_SCHEMA = ("additionalProperties", "items", "additionalItems", "not", "contains", "propertyNames", "if", "then",
           "else", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: dict) -> dict:
    """``schema`` with every object schema that names its keys (``properties`` or
    ``patternProperties``) and says nothing of other keys (no ``additionalProperties`` or
    ``unevaluatedProperties``) closed to them (``additionalProperties: false``): how llama.cpp's
    converter (``json-schema-to-grammar``) and xgrammar's strict mode, vLLM's default, read such a
    schema, and what clients that write schemas from classes (pydantic: instructor,
    pydantic-ai...) mean; a small model given open objects adds keys until its token limit.
    ``additionalProperties: true`` (or a schema) keeps an object open. A name in ``required``
    that ``properties`` does not give is one of the object's keys (added as ``true``; an object
    with ``patternProperties`` and such a name is left open). A schema that composes objects
    anywhere (``allOf``, or ``properties``, ``patternProperties`` or ``required`` beside
    ``anyOf``, ``oneOf`` or ``$ref``) is kept as given: llguidance intersects the parts, and a
    part closed to another's keys would refuse them (helpers' findings). Returns a new schema;
    ``schema`` is not changed. Memoized by the schema's JSON text (the last 256): a request's
    check and its grammar, and a client's next request with the same schema or tools, walk it
    once (a 46 KB schema takes 11 ms); the result is shared, so it is never to be changed.

    Raises:
        ValueError: ``minProperties`` above 1 where keys may come from ``additionalProperties`` or
            ``patternProperties``: llguidance keeps only the keys of ``properties`` unique, so a
            document could meet the count with one key repeated (a hostile helper's finding).
    """
    return _closed_objects(json.dumps(schema))


@functools.lru_cache(maxsize=256)
def _closed_objects(text: str) -> dict:
    """:func:`closed_objects` of the schema whose JSON text is ``text``."""
    schema = json.loads(text)

    def composes(node) -> bool:
        if not isinstance(node, dict):
            return False
        keys = any(k in node for k in ("properties", "patternProperties", "required"))
        return "allOf" in node or (keys and any(k in node for k in ("anyOf", "oneOf", "$ref"))) or \
            any(composes(n) for _, _, n in _subschemas(node))
    close = not composes(schema)

    def walk(node, path: str):
        if not isinstance(node, dict):
            return node  # true, false
        out = dict(node)
        for key, name, sub in _subschemas(node):
            walked = walk(sub, f"{path}/{key}" + (f"/{name}" if name is not None else ""))
            if name is None:
                out[key] = walked
            else:
                out[key] = out[key].copy() if out[key] is node[key] else out[key]
                out[key][name] = walked
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        undeclared = [k for k in node.get("required") or () if isinstance(k, str) and k not in declared]
        if close and ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node \
                and "unevaluatedProperties" not in node and not (undeclared and "patternProperties" in node):
            out["additionalProperties"] = False
            if undeclared:
                out["properties"] = {**out.get("properties", {}), **dict.fromkeys(undeclared, True)}
        open_keys = out.get("additionalProperties", True) is not False or "patternProperties" in node
        least = node.get("minProperties")
        if open_keys and isinstance(least, (int, float)) and not isinstance(least, bool) and least > 1:
            raise ValueError(f"minProperties above 1 (at {path or '/'}) needs keys kept unique, and the keys "
                             "beyond properties (additionalProperties, patternProperties) are not: a repeated key "
                             "could meet the count")
        return out
    return walk(schema, "")


def _subschemas(node: dict):
    """``(keyword, index or name or None, subschema)`` for each schema directly inside ``node``."""
    for key in _SCHEMA:
        if isinstance(node.get(key), list) and key == "items":  # draft 4's tuple form
            yield from ((key, i, n) for i, n in enumerate(node[key]))
        elif key in node:
            yield key, None, node[key]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from ((key, i, n) for i, n in enumerate(node[key]))
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((key, k, n) for k, n in node[key].items())


def tokenizer_from_vocab(vocab, n_vocab: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over a llama.cpp vocabulary, as ``llguidance.llamacpp.
    lltokenizer_from_vocab`` builds it (each token's bytes; control tokens, and user-defined
    ones written ``<...>``, marked special with a leading 0xFF; llama.cpp's ``llama_tokenize``
    for tokenizing), but through ``llama_vocab_get_attr``: the deprecated ``llama_token_get_attr``
    it calls raises a ``DeprecationWarning`` for every token (49,152 per build, each recorded by
    pytest). About 0.3 s for SmolLM2's vocabulary here.

    Args:
        eos: the token ids that end a grammar (the model's end-of-generation tokens).
    """
    buf = ctypes.create_string_buffer(16 * 1024)
    special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    tokens = []
    for t in range(n_vocab):
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        if n < 0:
            raise ValueError(f"token {t} does not fit {len(buf)} bytes")
        piece, attr = buf.raw[:n], llama_cpp.llama_vocab_get_attr(vocab, t)
        if attr & special or (attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<")
                              and piece.endswith(b">")):
            piece = b"\xff" + piece
        tokens.append(piece)
    tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=vocab, tokenize_fptr=tokenize,
                                                eos_token=eos, slices=None)


class CheckedGrammars:
    """A front end's memo of :func:`check`, run by a
    :class:`engine.llama.grammar_checker.GrammarChecker` (in a child process, bounded in time): the
    last ``capacity`` verdicts, per (tenant, grammar), so a tenant's repeated schema costs a
    dictionary lookup (and no tenant learns from a response's time which grammars another used).
    Thread-safe."""

    def __init__(self, capacity: int = 256):
        self.capacity, self.checker = capacity, GrammarChecker()
        self._verdicts: OrderedDict[tuple[int, str, bool], str] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, tenant: int, grammar: str, text_only: bool = False) -> str:
        """:func:`check`'s answer for ``tenant``'s ``grammar``."""
        key = (tenant, grammar, text_only)
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
                return verdict
        verdict = self.checker.check(grammar, text_only)  # outside the lock: cached checks do not wait
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.capacity:
                self._verdicts.popitem(last=False)
        return verdict


class GrammarConstraint:
    """One sequence's position in a grammar (the :class:`engine.llama.sampler.Constraint`
    protocol), over an ``LLMatcher`` of its own.

    Attributes:
        error: why the constraint failed ("" while it holds): a token the grammar refuses was
            generated (nothing it allows was left to sample), or the library hit a limit.
            A failed constraint ends its sequence with an error; it never goes on unconstrained.
        complete: the grammar is finished: nothing may follow but the end of generation.
    """

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int):
        self.matcher, self.n_vocab = matcher, n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, np.int32)
        self.error = matcher.get_error()
        self.complete = False

    def allows(self, token: int) -> bool:
        return not self.error and self.matcher.validate_tokens([token]) == 1

    def allowed(self) -> np.ndarray:
        """llguidance's bitmask of the next tokens (bit ``t % 32`` of word ``t // 32``), as ids.
        A sparse mask (the usual one after a refusal: a quote, a comma, a digit...) has only its
        non-zero words unpacked: measured 23 against 194 us for the whole 49k-token mask."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():  # no way on (a regex or schema with no instance): the mask
            self.error = self.matcher.get_error()  # holds only the end, which must not pass for one
            return np.zeros(0, np.int32)
        words = np.flatnonzero(self._bits)
        if len(words) > SPARSE_WORDS:
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.n_vocab)
            return np.flatnonzero(bits).astype(np.int32)
        bits = np.unpackbits(self._bits[words].view(np.uint8), bitorder="little").reshape(-1, 32)
        ids = (words[:, None] * 32 + _BIT)[bits.astype(bool)]
        return ids[ids < self.n_vocab].astype(np.int32)

    def accept(self, token: int) -> None:
        if self.error:
            return
        if not self.matcher.consume_token(token):
            self.error = self.matcher.get_error() or f"token {token} is not allowed by the grammar"
        else:
            self.complete = self.matcher.is_stopped()

    def free(self) -> None:
        self.matcher = None


class Grammars:
    """Compiles grammars into ``LLMatcher`` templates on one background thread (llguidance drops
    the GIL while it compiles, so the step loop keeps decoding) and keeps the last
    :data:`CACHE_ENTRIES`, keyed by tenant and grammar: as the prefix cache, a tenant never
    learns from its time to first token which grammars another tenant used. Each sequence gets
    a copy of the template (``deep_copy``, about a microsecond).

    The llguidance tokenizer is built from the model's vocabulary (:func:`tokenizer_from_vocab`, once)
    on the same thread, as soon as the engine starts, so the first grammar does not wait for it.

    Args:
        vocab: the model's ``llama_vocab``. eog: its end-of-generation token ids (any of them
            ends a grammar). n_vocab: its size.
    """

    def __init__(self, vocab, eog: frozenset, n_vocab: int, capacity: int = CACHE_ENTRIES):
        self.vocab, self.eog, self.n_vocab, self.capacity = vocab, sorted(eog), n_vocab, capacity
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[int, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = self._pool.submit(self._build_tokenizer)

    def compile(self, tenant: int, grammar: str) -> Future:
        """A future of the compiled template for ``tenant``'s ``grammar`` (a cached one when
        there is one). Its ``LLMatcher`` may be in error (``get_error()``) if the grammar does
        not compile; the front end's :func:`check` makes that rare."""
        key = (tenant, grammar)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._cache[key] = self._pool.submit(self._build, grammar)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return future

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        return tokenizer_from_vocab(self.vocab, self.n_vocab, self.eog)

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0, limits=limits())

    @staticmethod
    def failed(future: Future) -> bool:
        """Whether a finished :meth:`compile` gave nothing to constrain with: the grammar did not
        compile, or compiling raised."""
        return future.exception() is not None or future.result().is_error()

    def constraint(self, future: Future) -> GrammarConstraint:
        """A fresh sequence's constraint from a finished :meth:`compile`."""
        return GrammarConstraint(future.result().deep_copy(), self.n_vocab)

    def close(self) -> None:
        """Stop compiling: drop what has not started and wait for what has (the tokenizer's build,
        at most one grammar, which llguidance's :func:`limits` bound): both read the model's
        vocabulary, which the engine frees next. Not waiting crashed an engine stopped in the
        half second after its start (SIGSEGV in :func:`tokenizer_from_vocab`)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
