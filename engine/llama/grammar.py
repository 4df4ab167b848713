"""Grammar constraints with llguidance, the engine's side: what a constrained sequence may
generate next.

A constraint is an llguidance grammar (its JSON form: ``{"grammars": [...]}`` holding Lark, a
JSON schema or a regex), carried on the request as ``SamplingParams.grammar``; the front end
writes and checks it (``server/structured/``). The engine compiles it into an ``LLMatcher``
over the model's vocabulary (:class:`Grammars`, on a thread of its own and cached per tenant),
and each sequence walks its own copy (:class:`GrammarConstraint`), which
``engine/llama/sampler.py`` consults as llama.cpp's ``common_sampler`` consults its grammar:
the chain's token first, the allowed tokens only when it is refused.

Limits (docs/api.md "Structured outputs"): the grammar must fit the request's variable section
(``--max-request-extras-bytes``, 32 KiB by default), and compiling it is bounded by
:data:`engine.grammar_limits.LIMITS` (llguidance's fuel and size limits, the same in the front
end's check). Compiling never runs on the step loop's thread.
"""
from __future__ import annotations

import ctypes
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llama_cpp
import llguidance
import numpy as np

from engine.grammar_limits import limits
from engine.llama.json_keys import UniqueKeys

#: Compiled grammars the engine keeps (each entry one tenant's grammar; least recently used evicted).
CACHE_ENTRIES = 64


_BIT = np.arange(32)
#: Masks with more non-zero 32-token words than this are unpacked whole (cheaper then).
SPARSE_WORDS = 128


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
    # No slices: llguidance's default four (precomputed token subsets for JSON's strings and
    # whitespace, each a token trie of its own) held 62 MB more at Gemma 3's 262,144 tokens, and
    # speed up only a whole mask, which the sampler computes only after the chain's token was
    # refused (engine/llama/sampler.py). Without them a mask inside a JSON string took 0.2-0.3 ms
    # for that vocabulary, 2.3 ms in a string with ``maxLength`` (0.04 and 0.7 with them).
    return llguidance.LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=vocab, tokenize_fptr=tokenize,
                                                eos_token=eos, slices=[])


def is_json_document(grammar: str) -> bool:
    """Whether llguidance grammar ``grammar`` is one JSON schema and nothing else (its JSON form
    with one grammar, a ``json_schema``: what ``LLMatcher.grammar_from_json_schema`` writes), so
    that every byte generated under it is the JSON document."""
    try:
        grammars = json.loads(grammar).get("grammars")
    except (ValueError, AttributeError):  # Lark text, or JSON that is not an object
        return False
    return (isinstance(grammars, list) and len(grammars) == 1 and isinstance(grammars[0], dict)
            and grammars[0].get("json_schema") is not None and not grammars[0].get("lark_grammar"))


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

    def allowed(self, excluded: np.ndarray | None = None) -> np.ndarray:
        """llguidance's bitmask of the next tokens (bit ``t % 32`` of word ``t // 32``), as ids,
        less ``excluded`` (int32 ids; None: none).
        A sparse mask (the usual one after a refusal: a quote, a comma, a digit...) has only its
        non-zero words unpacked: measured 23 against 194 us for the whole 49k-token mask."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():  # no way on (a regex or schema with no instance): the mask
            self.error = self.matcher.get_error()  # holds only the end, which must not pass for one
            return np.zeros(0, np.int32)
        words = np.flatnonzero(self._bits)
        if len(words) > SPARSE_WORDS:
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.n_vocab)
            ids = np.flatnonzero(bits).astype(np.int32)
        else:
            bits = np.unpackbits(self._bits[words].view(np.uint8), bitorder="little").reshape(-1, 32)
            ids = (words[:, None] * 32 + _BIT)[bits.astype(bool)]
            ids = ids[ids < self.n_vocab].astype(np.int32)
        return ids if excluded is None or not len(excluded) else ids[~np.isin(ids, excluded)]

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
    A grammar that is one JSON schema (a response format's) gets each name once per object
    (:class:`engine.llama.json_keys.UniqueKeys`).

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
        there is one): its ``LLMatcher``, and whether the grammar is one JSON document
        (:func:`is_json_document`). The matcher may be in error (``get_error()``) if the grammar
        does not compile; the front end's check (``server.structured.check``) makes that rare."""
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
        tokenizer = tokenizer_from_vocab(self.vocab, self.n_vocab, self.eog)
        # The tokens that can end a JSON name (UniqueKeys): 0.1 s for a 262,144-token vocabulary.
        self._quoted = np.array([b'"' in tokenizer.decode_bytes([t]) for t in range(self.n_vocab)])
        return tokenizer

    def _build(self, grammar: str) -> tuple[llguidance.LLMatcher, bool]:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0, limits=limits())
        return matcher, is_json_document(grammar)

    @staticmethod
    def failed(future: Future) -> bool:
        """Whether a finished :meth:`compile` gave nothing to constrain with: the grammar did not
        compile, or compiling raised."""
        return future.exception() is not None or future.result()[0].is_error()

    def constraint(self, future: Future) -> GrammarConstraint | UniqueKeys:
        """A fresh sequence's constraint from a finished :meth:`compile`."""
        template, json_document = future.result()
        constraint = GrammarConstraint(template.deep_copy(), self.n_vocab)
        if not json_document:
            return constraint
        tokenizer = self._tokenizer.result()
        return UniqueKeys(constraint, lambda t: tokenizer.decode_bytes([t]), self._quoted)

    def close(self) -> None:
        """Stop compiling: drop what has not started and wait for what has (the tokenizer's build,
        at most one grammar, which llguidance's :func:`limits` bound): both read the model's
        vocabulary, which the engine frees next. Not waiting crashed an engine stopped in the
        half second after its start (SIGSEGV in :func:`tokenizer_from_vocab`)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
