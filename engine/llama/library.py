"""Opening llama.cpp: the library's one initialization, its log sink, loading a GGUF, reading
its metadata, the devices it reports, and the cache folder of files derived from a model.

Every other module of :mod:`engine.llama` and the front ends' tokenizer load models through
:func:`load_model`, so the library is initialized in one place.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
import llama_cpp

from engine.config import ConfigError, check_model_file


def cache_dir() -> str:
    """Folder of files derived from a model (converted weights, the AMX probe's answer):
    ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/inference-server``, or, when that cannot be
    created (a read-only home in a container), ``inference-server-<uid>`` in the temporary folder,
    this user's alone (mode 0700): in the shared folder itself another user could plant a file
    under a copy's predictable name for this user's engines to load.

    Raises:
        ConfigError: that temporary folder exists and is not this user's private folder.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "inference-server")
    try:
        os.makedirs(folder, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    folder = os.path.join(tempfile.gettempdir(), f"inference-server-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{folder} is not a folder of this user's alone (mode 0700); remove it, or set "
                          "XDG_CACHE_HOME to a writable folder")
    return folder


@llama_cpp.llama_log_callback
def _log_errors_only(level, text, user_data):
    """llama.cpp log sink: keep warnings and errors (GGML_LOG_LEVEL_WARN=3, ERROR=4)."""
    if level in (3, 4):
        os.write(2, text)


def _cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: Bumped whenever what :func:`_amx_probe` counts as a fault changes, so an answer remembered by
#: an older probe on this boot is not taken for its own (version 1 counted SIGILL only, and said
#: "runs" where ``ldtilecfg`` raised a general protection fault).
PROBE_VERSION = 2
#: How a CPU that advertises AMX faults on it: an invalid opcode (SIGILL) or a general protection
#: fault (SIGSEGV; SIGBUS for completeness), by VM.
FAULT_SIGNALS = frozenset({signal.SIGILL, signal.SIGSEGV, signal.SIGBUS})


@functools.cache
def amx_faults(path: str) -> bool:
    """Whether this CPU advertises AMX but faults on it running ``path`` (:func:`_amx_probe`),
    remembered for the machine's boot in the cache folder (keyed by :data:`PROBE_VERSION` too),
    so engine starts pay the probe's second or two once. CPUs without the ``amx_int8`` flag skip
    it (no cost on AMD). A probe that hangs counts as "faults" and is not remembered."""
    if "amx_int8" not in _cpu_flags():
        return False
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return _amx_probe(path) != "runs"
    identity = f"{boot}:{PROBE_VERSION}:{os.path.realpath(path)}:{os.path.getsize(path)}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    marker = os.path.join(cache_dir(), f"amx-probe-{key}")
    try:
        with open(marker) as f:
            return f.read() == "faults"
    except OSError:
        pass
    outcome = _amx_probe(path)
    if outcome == "hangs":
        return True  # the safe answer, not remembered: the next start probes again
    try:
        with open(f"{marker}.{os.getpid()}", "w") as f:
            f.write(outcome)
        os.replace(f"{marker}.{os.getpid()}", marker)
    except OSError:
        pass  # not remembered: the next start probes again
    return outcome == "faults"


#: Seconds the probe may take before it counts as hung (its decode of 8 tokens takes 1-2 s).
PROBE_TIMEOUT_S = 60.0

#: What the probe's fresh interpreter runs: load ``sys.argv[1]`` with the extra buffer types and
#: decode 8 tokens. Only ``llama_cpp`` is imported, so the child needs nothing of this package.
_PROBE_SCRIPT = """
import sys, llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.use_extra_bufts = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
ctx_params = llama_cpp.llama_context_default_params()
ctx_params.n_ctx, ctx_params.n_batch, ctx_params.n_threads, ctx_params.n_threads_batch = 64, 64, 1, 1
ctx = llama_cpp.llama_init_from_model(model, ctx_params)
tokens = (llama_cpp.llama_token * 8)(*range(1, 9))
llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, 8))
"""


def _amx_probe(path: str) -> str:
    """Whether this CPU advertises AMX but faults on it, so llama.cpp's AMX kernels (an "extra
    buffer type" of its CPU backend, used for Q4_0, Q4_1, Q8_0 and K-quants) must not be used:
    ``"faults"``, ``"runs"``, or ``"hangs"`` (no answer within :data:`PROBE_TIMEOUT_S`).

    Seen on Sapphire Rapids guests of Firecracker VMs: CPUID lists ``amx_int8`` and the kernel
    grants ``ARCH_REQ_XCOMP_PERM``, yet inside ``llama_decode`` the first ``tilezero`` is an
    invalid opcode (SIGILL) on some, and ``ldtilecfg`` a general protection fault (SIGSEGV, in
    ``ggml_backend_amx_mul_mat``) on others. Nothing short of running a tile instruction tells,
    so a child process loads ``path`` with the extra buffer types and decodes a few tokens; its
    death by one of :data:`FAULT_SIGNALS` is the answer. Loading without them always works, so
    a wrong "faults" costs speed only, a wrong "runs" every decode.
    """
    return run_outcome([sys.executable, "-c", _PROBE_SCRIPT, path], PROBE_TIMEOUT_S)


def run_outcome(argv: list[str], timeout_s: float) -> str:
    """How the command ``argv`` ends: ``"faults"`` (killed by one of :data:`FAULT_SIGNALS`),
    ``"hangs"`` (still running after ``timeout_s`` seconds; then killed), or ``"runs"`` (any
    other end: an exit of any status, another signal). stdout and stderr are discarded.

    A fresh interpreter, not a fork: a child forked from a process whose other threads hold
    locks (llama.cpp's OpenMP pool, a test runner's) can deadlock before it runs anything, as
    one did under pytest-xdist in CI (the engine's start then waited forever).
    """
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:  # subprocess.run has killed and reaped it
        return "hangs"
    return "faults" if -done.returncode in FAULT_SIGNALS else "runs"


def load_model(path: str, vocab_only: bool = False, n_gpu_layers: int = 0):
    """Load a GGUF model; returns the ``llama_model *``. Weights go into llama.cpp's extra CPU
    buffer types (repacked or AMX layouts) unless :func:`amx_faults` says this CPU faults on
    them; ``n_gpu_layers`` are offloaded to a GPU (-1: all).

    Raises:
        ConfigError: unreadable or non-GGUF file. RuntimeError: llama.cpp refused it.
    """
    check_model_file(path)
    return _load(path, vocab_only, extra_buffers=vocab_only or not amx_faults(path), n_gpu_layers=n_gpu_layers)


def _load(path: str, vocab_only: bool, extra_buffers: bool, n_gpu_layers: int = 0):
    llama_cpp.llama_log_set(_log_errors_only, None)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = extra_buffers
    params.use_mmap = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def metadata_value(path: str, key: str) -> str | None:
    """The GGUF's metadata value of ``key`` as llama.cpp renders it (``llama_model_meta_val_str``,
    up to 255 bytes), read with the vocabulary only; None when the file lacks the key.

    Raises:
        ConfigError: unreadable or non-GGUF file. RuntimeError: llama.cpp refused it.
    """
    model = load_model(path, vocab_only=True)
    try:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None
    finally:
        llama_cpp.llama_model_free(model)


def file_type(path: str) -> int:
    """The GGUF's ``general.file_type`` (a ``llama_ftype``); -1 when the file does not say."""
    value = metadata_value(path, "general.file_type")
    return int(value) if value and value.isdigit() else -1


def supports_gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU device to offload layers to
    (``llama_supports_gpu_offload``: a CUDA, Metal, Vulkan... backend reported a device)."""
    llama_cpp.llama_backend_init()
    return bool(llama_cpp.llama_supports_gpu_offload())
