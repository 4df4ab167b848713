"""What a set of models will hold resident, estimated before any starts, and the limit it must fit.

The estimate of one model (:func:`estimate`) is an upper bound from the GGUF's metadata and the
model's engine settings, in the terms of docs/operations.md "Memory":

- weights: the file's size, or the converted copy's (:mod:`engine.llama.weights`: ``auto``
  turns Q4_1 and Q5_1 into Q8_0, 8.5 bits a weight instead of 5 or 6);
- KV memory: the cells the engine may hold at once times the bytes of one cell, every layer's
  keys and values in f16 (``block_count x head_count_kv x (key_length + value_length) x 2``).
  A generation model holds at most ``kv_cache_tokens + prefix_cache_tokens + n_batch`` cells
  (the running sequences, the prefix cache, a step's new tokens: the size of the unified cache
  the engine falls back to, :meth:`engine.llama.model.Model.from_config`); an embedding
  model one batch (``max(n_batch, max_seq_len)`` cells, cleared after it);
- compute buffers: llama.cpp's logits, twice (:data:`engine.llama.model.LOGITS_BYTES`; an
  embedding engine's whole batch: llama.cpp makes each of its tokens an output, unless the
  engine loads the architecture's twin without the head, ``EMBEDDING_ARCHITECTURES``), and
  its graph's activations, :data:`ACTIVATION_FLOATS` floats per batch token and embedding unit;
- the engine process itself (:data:`PROCESS_BYTES`, and its vocabulary twice over:
  :data:`ENGINE_VOCAB_BYTES_PER_TOKEN`) and the front ends' tokenizer: one copy, which the
  gunicorn master loads before the workers and the gRPC sidecar fork
  (:data:`VOCAB_BYTES_PER_TOKEN`), and what each may come to copy of it
  (:data:`PIECES_BYTES_PER_TOKEN`).

The limit is ``--memory-limit``, or the memory available now: ``MemAvailable`` of
``/proc/meminfo``, or what the cgroup (a container's limit) leaves, whichever is less.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ConfigError
from server.gguf import metadata

if TYPE_CHECKING:
    from engine.config import EngineConfig

#: Resident bytes of an engine process beside its model: the interpreter, numpy, llama.cpp's
#: library and threads (an idle engine of SmolLM2 without its weights and KV memory: measured
#: 95 MB on this project's machine; rounded up).
PROCESS_BYTES = 120 << 20
#: Floats of activations per batch token and embedding unit in llama.cpp's compute buffer (the
#: graph's largest intermediate tensors, the feed-forward's included); llama.cpp reported 8.4 MB
#: for SmolLM2 (576 units) at 512 tokens, 32 floats a unit and token with room to spare.
ACTIVATION_FLOATS = 32
#: Resident bytes per vocabulary entry of the engine's two views of it, llama.cpp's vocabulary
#: and llguidance's token trie (``engine.llama.grammar.tokenizer_from_vocab``): 185 bytes each
#: measured for Gemma 3's 262,144 entries.
ENGINE_VOCAB_BYTES_PER_TOKEN = 370
#: Resident bytes per vocabulary entry of the front ends' tokenizer (``vocab_only``, and
#: ``Tokenizer.pieces``), which the forked front ends share with the master: 236 bytes measured
#: for Gemma 3's 262,144 entries.
VOCAB_BYTES_PER_TOKEN = 240
#: Resident bytes per vocabulary entry each front end may come to copy of the shared tokenizer:
#: ``Tokenizer.pieces``, Python objects whose reference counts are written as tokens are decoded.
PIECES_BYTES_PER_TOKEN = 48
#: Bits per weight of llama.cpp's file types (``general.file_type``, ``enum llama_ftype``) that
#: the weight formats convert from or to: F32, F16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, BF16.
_BITS = {0: 32.0, 1: 16.0, 2: 4.5, 3: 5.0, 7: 8.5, 8: 5.5, 9: 6.0, 32: 16.0}
_TARGET_BITS = {"q8_0": 8.5, "bf16": 16.0, "f16": 16.0}
#: File types ``auto`` converts to Q8_0 (engine.llama.weights.UNBATCHED_FILE_TYPES).
_AUTO_CONVERTED = (3, 9)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str, what: str) -> int:
    """``text`` (``8GB``, ``512MiB``, ``1.5 GB``, or a number of bytes) in bytes.

    Raises:
        ConfigError: not a positive size, naming ``what``.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what} must be a size such as 8GB, 512MiB or a number of bytes, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Estimate:
    """One model's resident bytes, by part (see the module's docstring)."""

    weights: int
    kv: int
    compute: int
    process: int
    front_ends: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.process + self.front_ends

    def describe(self) -> str:
        return (f"{self.total / 1e6:,.0f} MB (weights {self.weights / 1e6:,.0f}, KV {self.kv / 1e6:,.0f}, "
                f"compute {self.compute / 1e6:,.0f}, processes {(self.process + self.front_ends) / 1e6:,.0f})")


def estimate(config: "EngineConfig", front_ends: int) -> Estimate:
    """The most ``config``'s engine and ``front_ends`` front-end processes hold for its model.

    Raises:
        ConfigError: the GGUF's metadata cannot be read.
    """
    path = config.model_path
    arch = metadata(path, ("general.architecture",)).get("general.architecture", "")
    keys = {k: f"{arch}.{k}" for k in ("block_count", "embedding_length", "attention.head_count",
                                       "attention.head_count_kv", "attention.key_length",
                                       "attention.value_length", "vocab_size")}
    meta = metadata(path, tuple(keys.values()) + ("general.file_type", "tokenizer.ggml.tokens"), arrays=True)
    get = lambda k, default=0: int(meta.get(keys[k], default))  # noqa: E731
    n_embd, n_head = get("embedding_length"), max(1, get("attention.head_count", 1))
    n_head_kv = get("attention.head_count_kv", n_head)  # an array (per-layer counts): its length, a bound
    head = n_embd // n_head
    key, value = get("attention.key_length", head), get("attention.value_length", head)
    cell = get("block_count") * n_head_kv * (key + value) * 2
    n_vocab = int(meta.get("tokenizer.ggml.tokens", 0))
    if config.kind == "embed":
        ubatch = max(config.n_batch, config.max_seq_len)  # a longer input decodes alone
        cells = -(-ubatch // 256) * 256
        # llama.cpp makes every token of an embedding batch an output: a causal LM's logits of
        # the whole batch, in its output and its compute buffer; none where the engine loads the
        # architecture's embedding twin, whose graph has no language-model head
        from engine.llama.embedding import EMBEDDING_ARCHITECTURES  # noqa: PLC0415 - as below
        logits = 0 if arch in EMBEDDING_ARCHITECTURES else 2 * 4 * n_vocab * ubatch
    else:
        cells = config.kv_cache_tokens + config.prefix_cache_tokens + config.n_batch
        from engine.llama.model import LOGITS_BYTES  # noqa: PLC0415 - llama.cpp only when estimating
        logits = 2 * LOGITS_BYTES
    return Estimate(weights=_weights_bytes(path, config.weights, meta.get("general.file_type")),
                    kv=cells * cell, compute=logits + ACTIVATION_FLOATS * 4 * n_embd * config.n_batch,
                    process=PROCESS_BYTES + ENGINE_VOCAB_BYTES_PER_TOKEN * n_vocab,
                    front_ends=(VOCAB_BYTES_PER_TOKEN + front_ends * PIECES_BYTES_PER_TOKEN) * n_vocab)


def _weights_bytes(path: str, weights: str, file_type: int | None) -> int:
    size = os.path.getsize(path)
    source = _BITS.get(file_type) if file_type is not None else None
    if weights == "auto" and file_type in _AUTO_CONVERTED:
        target = _TARGET_BITS["q8_0"]
    elif weights in _TARGET_BITS:
        target = _TARGET_BITS[weights]
    else:
        return size
    return int(size * target / source) if source else size


def available_bytes() -> int:
    """Memory available to this server now: ``MemAvailable`` (``/proc/meminfo``), or less where
    a cgroup v2 limit (``memory.max`` less ``memory.current``) leaves less."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            avail = min(avail, int(limit) - current)
    except (OSError, ValueError):
        pass
    return avail


def check(estimates: dict[str, Estimate], limit: int | None) -> None:
    """Raise ConfigError (one line) when the models' estimates add up to more than ``limit``
    bytes (None: :func:`available_bytes`), naming each model's estimate."""
    total = sum(e.total for e in estimates.values())
    budget = limit if limit is not None else available_bytes()
    if total > budget:
        parts = "; ".join(f"{name}: {e.describe()}" for name, e in estimates.items())
        where = "--memory-limit" if limit is not None else "the memory available now"
        raise ConfigError(f"the models need about {total / 1e6:,.0f} MB, more than {where} ({budget / 1e6:,.0f} MB): "
                          f"{parts}; serve fewer models, or give them less to hold: a generation model fewer "
                          "kv_cache_tokens or prefix_cache_tokens, an embedding model a smaller n_batch and max_seq_len "
                          "(docs/models.md)")
