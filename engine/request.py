"""The one request type, from the front end's parser to the engine's sampler.

:class:`SamplingParams` is built by a front end's parser (``server/api/requests.py``), carried inside
:class:`EngineRequest` through the request ring, and read by ``engine/llama/sampler.py``. Its wire
form is derived from the fields (their ``wire`` metadata), so adding a sampler option touches
this class, its parser and the sampler, nothing else. As vLLM v1 carries one ``SamplingParams``
inside ``EngineCoreRequest``; the record replaces its msgpack.

A record has a fixed part (numbers, the prompt's token ids) and a bounded variable section
(``extras``): fields declared ``wire="blob"`` (``logit_bias``, ``grammar``)
travel there as one JSON object, length-prefixed. Its bound is set at start-up
(``EngineConfig.max_request_extras_bytes``, sized into the ring as the rest is), and a request
that needs more is refused before it is queued (:meth:`EngineRequest.resolved`).
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum

import numpy as np

from engine.errors import InvalidRequest, PromptTooLong
from shm.layout import MAX_TOP_LOGPROBS

#: Most request-specific stop token ids carried in one record.
MAX_STOP_IDS = 8
#: Largest ``max_new_tokens`` / ``top_k`` accepted (int32 on the wire).
INT32_MAX = 2**31 - 1
#: Bounds of a ``logit_bias`` value (OpenAI's API reference: -100 bans, 100 forces).
LOGIT_BIAS_BOUNDS = {"lo": -100, "hi": 100}
#: Seeds are reduced modulo this, so none becomes 0xFFFFFFFF: llama.cpp's ``LLAMA_DEFAULT_SEED``,
#: which means "a random seed" and would make a seeded request irreproducible.
SEED_MODULUS = 2**32 - 1


def reduce_seed(seed: int) -> int:
    """Any integer seed (OpenAI allows the signed 64-bit range) as a reproducible llama.cpp
    seed in ``[0, 2**32 - 2]``."""
    return seed % SEED_MODULUS


class RequestKind(IntEnum):
    """What the engine does with a request (the record's ``kind``)."""

    GENERATE = 0  #: sample tokens after the prompt
    #: publish the log-probability of every prompt token after the first (with the top
    #: ``logprobs`` alternatives), then sample ``max_new_tokens`` tokens, which may be 0
    SCORE = 1
    #: the prompt (the input's token ids, up to ``max_seq_len`` of them) pooled into one unit
    #: vector; nothing is sampled (``max_new_tokens`` 0). Served by an embedding engine only
    #: (``EngineConfig.kind`` ``embed``; :class:`engine.embed_core.EmbedCore`).
    EMBED = 2


class Priority(IntEnum):
    """Priority classes, in admission order (a smaller value is admitted first)."""

    HIGH = 0
    NORMAL = 1
    LOW = 2



def _field(default, wire: str, lo=None, hi=None, lo_open: bool = False):
    """A field with its wire type and its bounds (``lo``/``hi`` None: unbounded).

    ``wire`` is a numpy dtype string: ``i4``/``i8``/``f4`` (a number; None encodes as -1),
    ``?`` (a bool), or ``(N,)i4`` (a tuple of at most N ints, with a count field ``n_<name>``);
    or ``blob``: any JSON-able value, carried in the record's variable section (module doc).
    """
    return field(default=default, metadata={"wire": wire, "bounds": (lo, hi, lo_open)})


def _is_array(f) -> bool:
    return f.metadata["wire"].startswith("(")


def _is_blob(f) -> bool:
    return f.metadata["wire"] == "blob"


def _checked(name: str, value, lo=None, hi=None, lo_open: bool = False, integer: bool = False):
    """``value`` as an int (``integer``) or a float, if it is a finite number within bounds: the
    invariant of these types, whoever builds them (a client's JSON is checked, with its own
    field paths, by the front end's parser first: ``server/api/fields.py``).

    Raises:
        InvalidRequest: naming ``name``.
    """
    is_number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not is_number or (isinstance(value, (float, np.floating)) and not math.isfinite(value)) or \
            (integer and isinstance(value, (float, np.floating)) and not float(value).is_integer()) or \
            (lo is not None and (value < lo or (lo_open and value == lo))) or (hi is not None and value > hi):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequest(f"{name} must be {'an integer' if integer else 'a number'} in {bound}, got {value!r}",
                             name)
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, with llama.cpp's sampler-chain semantics.

    Attributes:
        max_new_tokens: generated tokens at most; None = up to the sequence limit; 0 only for a
            scoring request (:class:`RequestKind`).
        temperature: 0 = greedy. top_k: 0 = off. top_p, min_p: 1.0 / 0.0 = off.
        repeat_penalty (1 = off), presence_penalty, frequency_penalty (0 = off) over the last
        ``penalty_last_n`` tokens (-1: the whole sequence; 0: none). seed: None = random;
        otherwise ``0 .. 2**32 - 2`` (see :func:`reduce_seed`).
        ignore_eos: never sample end-of-generation tokens (fixed-length benchmarks).
        logprobs: None, or k in 0..20: return the sampled token's log-probability and the top-k.
        stop_ids: extra token ids that end the sequence (EOS/EOG always do unless ignore_eos).
        logit_bias: ``((token id, bias), ...)`` added to those tokens' logits before sampling,
            bias in [-100, 100] (OpenAI's ``logit_bias``; llama.cpp's logit-bias sampler).
        grammar: what the sequence may generate, as an llguidance grammar (its JSON form,
            ``{"grammars": [...]}``: Lark, JSON schema or regex; ``engine/llama/grammar.py``),
            or None: anything. Each sequence walks it on its own; when it is complete the
            sequence stops. Checked by the front end (``server.structured.check``).
    Raises:
        InvalidRequest: a value out of its bounds (the same bounds the HTTP parser checks).
    """

    max_new_tokens: int | None = _field(None, "i4", 0, INT32_MAX)  # 0: a scoring request only
    temperature: float = _field(1.0, "f4", 0, 2)
    top_k: int = _field(0, "i4", 0, INT32_MAX)
    top_p: float = _field(1.0, "f4", 0, 1)  # 0 keeps only the most likely token: greedy
    min_p: float = _field(0.0, "f4", 0, 1)
    repeat_penalty: float = _field(1.0, "f4", 0, 10, lo_open=True)
    presence_penalty: float = _field(0.0, "f4", -2, 2)
    frequency_penalty: float = _field(0.0, "f4", -2, 2)
    penalty_last_n: int = _field(64, "i4", -1, INT32_MAX)
    seed: int | None = _field(None, "i8", 0, SEED_MODULUS - 1)
    ignore_eos: bool = _field(False, "?")
    logprobs: int | None = _field(None, "i1", 0, MAX_TOP_LOGPROBS)
    stop_ids: tuple[int, ...] = _field((), f"({MAX_STOP_IDS},)i4")
    logit_bias: tuple[tuple[int, float], ...] = _field((), "blob")
    grammar: str | None = _field(None, "blob")

    def __post_init__(self):
        for f in fields(self):
            value, wire = getattr(self, f.name), f.metadata["wire"]
            if f.name == "logit_bias":
                value = tuple((_checked("logit_bias", t, lo=0, integer=True),
                               _checked("logit_bias", b, **LOGIT_BIAS_BOUNDS)) for t, b in value)
            elif f.name == "grammar":
                if value is not None and not isinstance(value, str):
                    raise InvalidRequest("grammar must be a string", "grammar")
            elif _is_array(f):
                size = np.dtype(wire).shape[0]
                if len(value) > size:
                    raise InvalidRequest(f"{f.name} holds at most {size} values, got {len(value)}", f.name)
                value = tuple(int(v) for v in value)
            elif wire == "?":
                value = bool(value)
            elif value is not None:
                value = _checked(f.name, value, *f.metadata["bounds"], integer=wire[0] == "i")
            object.__setattr__(self, f.name, value)

    @staticmethod
    def bounds(name: str) -> dict:
        """``lo``, ``hi``, ``lo_open`` and ``integer`` of field ``name``, for a parser's checks."""
        f = SamplingParams.__dataclass_fields__[name]
        lo, hi, lo_open = f.metadata["bounds"]
        return {"lo": lo, "hi": hi, "lo_open": lo_open, "integer": f.metadata["wire"][0] == "i"}

    @staticmethod
    def wire_fields() -> list[tuple[str, str]]:
        """``(name, dtype)`` of each field in the record, and the count of each tuple field."""
        out = []
        for f in fields(SamplingParams):
            if _is_blob(f):
                continue
            out.append((f.name, f.metadata["wire"]))
            if _is_array(f):
                out.append((f"n_{f.name}", "i4"))
        return out

    def extras(self) -> dict:
        """The ``blob`` fields that differ from their defaults (the variable section's content)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if _is_blob(f) and getattr(self, f.name) != f.default}

    def extras_bytes(self) -> bytes:
        """The variable section's bytes: the ``blob`` fields as one JSON object (b"" if none)."""
        blobs = self.extras()
        return json.dumps(blobs, separators=(",", ":")).encode() if blobs else b""

    def check_extras(self, extras_bytes: int, fields: FieldNames | None = None) -> None:
        """Raise unless the variable section fits ``extras_bytes``.

        Raises:
            InvalidRequest: naming the largest ``blob`` field (``grammar`` as ``fields`` names it).
        """
        if len(extras := self.extras_bytes()) > extras_bytes:
            blobs = self.extras()
            name = max(blobs, key=lambda k: len(json.dumps(blobs[k])))
            param = (fields or FieldNames()).grammar if name == "grammar" else name
            raise InvalidRequest(f"{name} needs {len(extras)} bytes of the request's variable section; this "
                                 f"server carries at most {extras_bytes} (--max-request-extras-bytes)", param)

    def encode(self, rec) -> None:
        """Write the fixed fields into a record with :meth:`wire_fields` (None as -1)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if _is_blob(f):
                continue
            if _is_array(f):
                rec[f.name][:len(value)] = value
                rec[f"n_{f.name}"] = len(value)
            else:
                rec[f.name] = -1 if value is None else value

    @classmethod
    def decode(cls, rec, extras: dict) -> "SamplingParams":
        """Inverse of :meth:`encode` and :meth:`extras` (skips validation: the front end
        validated it)."""
        obj = object.__new__(cls)
        for f in fields(cls):
            if _is_blob(f):
                value = extras.get(f.name, f.default)
                if f.name == "logit_bias":
                    value = tuple((int(t), float(b)) for t, b in value)
            elif _is_array(f):
                value = tuple(rec[f.name][:int(rec[f"n_{f.name}"])].tolist())
            else:
                value = rec[f.name].item()
                if f.default is None and value == -1:
                    value = None
            object.__setattr__(obj, f.name, value)
        return obj


def check_prompt_fits(n_prompt: int, max_seq_len: int, param: str | None = "prompt",
                      kind: RequestKind = RequestKind.GENERATE) -> None:
    """The one length rule for a prompt: at most ``max_seq_len - 1`` tokens, so that one sequence
    holds it and a token after it; an embedding's input (``kind`` EMBED), which is followed by
    nothing, at most ``max_seq_len``.

    Raises:
        PromptTooLong: naming ``param``.
    """
    room = 0 if kind == RequestKind.EMBED else 1
    if n_prompt > max_seq_len - room:
        raise PromptTooLong(n_prompt, max_seq_len, param=param, room=room)


@dataclass(frozen=True)
class FieldNames:
    """The request fields, as the client named them, that a refusal of
    :meth:`EngineRequest.resolved` names (OpenAI's ``param``): where the prompt came from, the
    most tokens to generate, and the grammar (None: the request has none)."""

    prompt: str = "prompt"
    max_new_tokens: str = "max_tokens"
    grammar: str | None = "grammar"


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate: what a request-ring record carries (token ids only).

    Attributes:
        prompt: token ids ``[n_prompt]`` (int32 numpy array once decoded).
        sampling: the sampler's settings; ``max_new_tokens`` is resolved (never None) on the wire.
        priority: admission class. deadline: ``time.monotonic()`` seconds, 0 = none.
        tenant, weight: fair-share identity and weight (VTC).
        kind: what to do with it (:class:`RequestKind`).
    """

    prompt: np.ndarray
    sampling: SamplingParams
    priority: Priority = Priority.NORMAL
    deadline: float = 0.0
    tenant: int = 0
    weight: float = 1.0
    kind: RequestKind = RequestKind.GENERATE

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def wire_dtype(max_seq_len: int, extras_bytes: int = 0) -> np.dtype:
        """The payload of one request-ring record for sequences of ``max_seq_len`` tokens and a
        variable section of at most ``extras_bytes``."""
        return np.dtype([("tenant", "i8"), ("weight", "f4"), ("priority", "i1"), ("kind", "i1"),
                         ("deadline", "f8"), *SamplingParams.wire_fields(),
                         ("n_prompt", "i4"), ("prompt", "i4", (max_seq_len,)),
                         ("n_extras", "i4"), ("extras", "u1", (extras_bytes,))])

    def extras(self) -> bytes:
        """The variable section's bytes (:meth:`SamplingParams.extras_bytes`)."""
        return self.sampling.extras_bytes()

    def encode(self, payload: np.ndarray, max_seq_len: int) -> None:
        """Write this request into a record's payload bytes (``uint8 [wire_dtype.itemsize]``)."""
        rec = payload.view(self.wire_dtype(max_seq_len, extras_room(len(payload), max_seq_len)))[0]
        rec["tenant"], rec["weight"], rec["priority"], rec["kind"], rec["deadline"] = (
            self.tenant, self.weight, self.priority, self.kind, self.deadline)
        self.sampling.encode(rec)
        rec["n_prompt"] = len(self.prompt)
        rec["prompt"][:len(self.prompt)] = self.prompt
        extras = self.extras()
        rec["n_extras"] = len(extras)
        rec["extras"][:len(extras)] = np.frombuffer(extras, np.uint8)

    @classmethod
    def decode(cls, payload: np.ndarray, max_seq_len: int) -> "EngineRequest":
        """Inverse of :meth:`encode`; the prompt is copied out.

        Raises:
            ValueError: a variable section that is not the JSON :meth:`extras` writes.
        """
        rec = payload.view(cls.wire_dtype(max_seq_len, extras_room(len(payload), max_seq_len)))[0]
        n, n_extras = int(rec["n_prompt"]), int(rec["n_extras"])
        extras = json.loads(rec["extras"][:n_extras].tobytes()) if n_extras else {}
        return cls(prompt=np.array(rec["prompt"][:n], dtype=np.int32),
                   sampling=SamplingParams.decode(rec, extras), priority=Priority(int(rec["priority"])),
                   deadline=float(rec["deadline"]), tenant=int(rec["tenant"]),
                   weight=float(rec["weight"]), kind=RequestKind(int(rec["kind"])))

    @staticmethod
    def deadline_after(deadline_ms: float | None) -> float:
        """``time.monotonic()`` seconds ``deadline_ms`` from now (0.0: none).

        Raises:
            InvalidRequest: not a positive, finite number.
        """
        if deadline_ms is None:
            return 0.0
        ms = _checked("deadline_ms", deadline_ms, **DEADLINE_MS_BOUNDS)
        return time.monotonic() + ms / 1000.0

    def resolved(self, max_seq_len: int, extras_bytes: int | None = None,
                 fields: FieldNames = FieldNames()) -> "EngineRequest":
        """This request with ``max_new_tokens`` resolved against ``max_seq_len``, checked to fit
        a record whose variable section holds ``extras_bytes`` (None: unchecked).

        An embedding (``kind`` EMBED) generates nothing: its ``max_new_tokens`` resolves to 0, and
        its input may fill the sequence (:func:`check_prompt_fits`).

        Raises (each naming the field of ``fields`` at fault):
            InvalidRequest: empty prompt, ``max_new_tokens`` 0 for a request that is not
            scoring or embedding, more than 0 for an embedding, or a variable section larger than
            ``extras_bytes`` (naming the largest ``blob`` field). PromptTooLong: the prompt (plus
            ``max_new_tokens``) does not fit one sequence.
        """
        n, max_new = len(self.prompt), self.sampling.max_new_tokens
        if n < 1:
            raise InvalidRequest("prompt is empty", fields.prompt)
        if self.kind == RequestKind.EMBED:
            if max_new:
                raise InvalidRequest(f"an embedding generates no tokens: max_new_tokens must be 0, got {max_new}",
                                     fields.max_new_tokens)
        elif max_new == 0 and self.kind != RequestKind.SCORE:
            raise InvalidRequest("max_new_tokens must be at least 1 for a request that generates",
                                 fields.max_new_tokens)
        if extras_bytes is not None:
            self.sampling.check_extras(extras_bytes, fields)
        check_prompt_fits(n, max_seq_len, fields.prompt, self.kind)
        if self.kind == RequestKind.EMBED:
            return self if max_new == 0 else replace(self, sampling=replace(self.sampling, max_new_tokens=0))
        if max_new is None:
            return replace(self, sampling=replace(self.sampling, max_new_tokens=max_seq_len - n))
        if n + max_new > max_seq_len:
            raise PromptTooLong(n, max_seq_len, max_new, param=fields.max_new_tokens)
        return self


#: ``deadline_ms`` accepted by every front end: more than 0, at most about 11.5 days.
DEADLINE_MS_BOUNDS = {"lo": 0, "hi": 1e9, "lo_open": True}


def record_bytes(max_seq_len: int, extras_bytes: int = 0) -> int:
    """Payload size of a request-ring record (``shm.layout.Layout.record_bytes``)."""
    return EngineRequest.wire_dtype(max_seq_len, extras_bytes).itemsize


def extras_room(payload_bytes: int, max_seq_len: int) -> int:
    """The variable section's bound in a record of ``payload_bytes`` (inverse of
    :func:`record_bytes`)."""
    return payload_bytes - record_bytes(max_seq_len)
