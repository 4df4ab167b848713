"""Opening llama.cpp: the library's one initialization, its log sink, loading a GGUF, reading
its metadata, the devices it reports, and the cache folder of files derived from a model.

Every other module of :mod:`engine.llama` and the front ends' tokenizer load models through
:func:`load_model`, so the library is initialized in one place.
"""
from __future__ import annotations

import ctypes
import faulthandler
import functools
import hashlib
import os
import signal
import tempfile
from typing import Callable

import llama_cpp

from engine.config import check_model_file


def cache_dir() -> str:
    """Folder of files derived from a model (converted weights, the AMX probe's answer):
    ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/inference-server``, or the temporary folder when
    that cannot be created (a read-only home in a container)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "inference-server")
    try:
        os.makedirs(folder, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return tempfile.gettempdir()


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
    it (no cost on AMD)."""
    if "amx_int8" not in _cpu_flags():
        return False
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return _amx_probe(path)
    identity = f"{boot}:{PROBE_VERSION}:{os.path.realpath(path)}:{os.path.getsize(path)}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    marker = os.path.join(cache_dir(), f"amx-probe-{key}")
    try:
        with open(marker) as f:
            return f.read() == "faults"
    except OSError:
        pass
    faults = _amx_probe(path)
    try:
        with open(f"{marker}.{os.getpid()}", "w") as f:
            f.write("faults" if faults else "runs")
        os.replace(f"{marker}.{os.getpid()}", marker)
    except OSError:
        pass  # not remembered: the next start probes again
    return faults


def _amx_probe(path: str) -> bool:
    """Whether this CPU advertises AMX but faults on it, so llama.cpp's AMX kernels (an "extra
    buffer type" of its CPU backend, used for Q4_0, Q4_1, Q8_0 and K-quants) must not be used.

    Seen on Sapphire Rapids guests of Firecracker VMs: CPUID lists ``amx_int8`` and the kernel
    grants ``ARCH_REQ_XCOMP_PERM``, yet inside ``llama_decode`` the first ``tilezero`` is an
    invalid opcode (SIGILL) on some, and ``ldtilecfg`` a general protection fault (SIGSEGV, in
    ``ggml_backend_amx_mul_mat``) on others. Nothing short of running a tile instruction tells,
    so a forked child loads ``path`` with the extra buffer types and decodes a few tokens; its
    death by one of :data:`FAULT_SIGNALS` is the answer. Loading without them always works, so
    a wrong "faults" costs speed only, a wrong "runs" every decode.
    """
    return dies_of_fault(lambda: _decode_with_extra_buffers(path))


def dies_of_fault(run: Callable[[], object]) -> bool:
    """Whether ``run()``, called in a forked child, kills it with one of :data:`FAULT_SIGNALS`;
    any other end (a return, an exception) is "no fault"."""
    pid = os.fork()
    if pid == 0:
        try:
            faulthandler.disable()  # its death is the answer, not an error to print
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            run()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) in FAULT_SIGNALS


def _decode_with_extra_buffers(path: str) -> None:
    model = _load(path, vocab_only=False, extra_buffers=True)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 64, 64, 1, 1
    ctx = llama_cpp.llama_init_from_model(model, params)
    tokens = (llama_cpp.llama_token * 8)(*range(1, 9))
    llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, 8))


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


def file_type(path: str) -> int:
    """The GGUF's ``general.file_type`` (a ``llama_ftype``); -1 when the file does not say."""
    model = load_model(path, vocab_only=True)
    try:
        buf = ctypes.create_string_buffer(32)
        n = llama_cpp.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
        return int(buf.value) if n > 0 and buf.value.isdigit() else -1
    finally:
        llama_cpp.llama_model_free(model)


def supports_gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU device to offload layers to
    (``llama_supports_gpu_offload``: a CUDA, Metal, Vulkan... backend reported a device)."""
    llama_cpp.llama_backend_init()
    return bool(llama_cpp.llama_supports_gpu_offload())
