"""The weight format the engine computes with: the GGUF file's own, or a copy converted once,
at start-up, to a format llama.cpp's CPU backend multiplies in batches.

Why convert: llama.cpp has no batched (GEMM) CPU kernel for Q4_1 or Q5_1 weights. Neither
llamafile's tinyBLAS (``ggml-cpu/llamafile/sgemm.cpp``: F32, F16, BF16, Q8_0, Q4_0, Q5_0,
IQ4_NL) nor a repacked layout (``ggml-cpu/repack.cpp``: Q4_0, Q4_K, Q2_K, IQ4_NL, ...) covers
them, so every matrix product runs one dot product at a time, and decoding 16 sequences
together gains little over one. The bundled SmolLM2-135M is Q4_1. Converted to Q8_0 (one
8-bit step is 1/17 of a Q4_1 step, so the weights barely move), the same model decodes 16
sequences 1.6 times as fast and one sequence faster too (bench/README.md, "Weights"); the CPU
backend profile asks for it (:mod:`engine.llama.backend`).

The outputs are not bit-identical to the Q4_1 file's: llama.cpp rounds activations to 8 bits
for Q4_1 products and not for the converted weights. Against the Q4_1 file, on 1,000 tokens of
text, the converted model's perplexity is the same (23.50 against 23.57) and its most likely
next token agrees 96 % of the time; an F16 copy, exact to 2^-12, agrees just as often, so the
difference is the rounding of the file's own products, not the conversion.

``auto`` (the default) converts only Q4_1 and Q5_1 files, to Q8_0; ``file`` never converts;
``q8_0``, ``bf16`` and ``f16`` convert any file. The copy is written once per source file
(path, size and modification time) under :func:`cache_dir`, atomically, so engines starting
together never load a half-written file. Beside it, ``<copy>.source`` names that source and its
file type (so later starts with ``auto`` decide without reading the file); each new conversion
removes the copies whose source is gone or changed (no start can ask for them again: their key
is of a file that no longer exists), so a new checkout or a replaced model does not leave its
old copy behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
from typing import Callable

import llama_cpp

from engine.config import WEIGHTS, ConfigError
from engine.llama.backend import CPU, Backend
from engine.llama.library import cache_dir, file_type

log = logging.getLogger("engine.weights")
#: Beside each converted copy: the JSON identity and file type of its source (:func:`remove_stale_copies`).
SOURCE_SUFFIX = ".source"

#: llama.cpp file types (``general.file_type``, ``enum llama_ftype`` in llama.h) with no batched
#: CPU kernel, which ``auto`` converts to Q8_0.
UNBATCHED_FILE_TYPES = {llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1: "Q4_1", llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1: "Q5_1"}
_TARGETS = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
            "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}
#: The kinds of copy the cache holds: the converted formats, and ``embed``, the copy of an
#: embedding model's weights under the architecture whose graph stops at the hidden states
#: (:func:`engine.llama.embedding.embedding_weights_path`).
COPY_KINDS = (*_TARGETS, "embed")
#: A copy's name (:func:`cached_copy`): only such files are ever removed.
_COPY_NAME = re.compile(r".+\.[0-9a-f]{16}\.(?:" + "|".join(COPY_KINDS) + r")\.gguf")


def target(path: str, weights: str, backend: Backend = CPU, folder: str | None = None) -> str | None:
    """The format ``weights`` asks for this file (a key of the conversions), or None to load
    the file as it is; ``auto`` converts only where ``backend`` has no batched kernel for it
    (the file's type read from the record of its copy in ``folder``, default :func:`cache_dir`,
    when there is one: :func:`source_file_type`).

    Raises:
        ValueError: ``weights`` is not one of :data:`WEIGHTS`.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "file":
        return None
    if weights == "auto":
        unbatched = backend.convert_unbatched and source_file_type(path, folder) in UNBATCHED_FILE_TYPES
        return "q8_0" if unbatched else None
    return weights


def source_file_type(path: str, folder: str | None = None) -> int:
    """``file_type(path)``, taken from the ``.source`` record of the file's Q8_0 copy in
    ``folder`` (default :func:`cache_dir`) when that record is of this very file: llama.cpp
    reads it only with the whole vocabulary (0.16 CPU-s for the bundled model's), which every
    engine start with ``auto`` would otherwise pay to learn what its first start learned."""
    source = _identity(path)
    saved = _read_record(_copy_path(path, source, "q8_0", folder or cache_dir()))
    if type(saved.get("file_type")) is int and all(saved.get(k) == v for k, v in source.items()):  # not a bool
        return saved["file_type"]
    return file_type(path)


def _copy_path(path: str, source: dict, fmt: str, folder: str) -> str:
    """Where the ``fmt`` copy of ``path`` (whose :func:`_identity` is ``source``) lives in ``folder``."""
    key = hashlib.sha256("|".join(str(source[k]) for k in ("path", "size", "mtime_ns")).encode()).hexdigest()[:16]
    return os.path.join(folder, f"{os.path.basename(path).removesuffix('.gguf')}.{key}.{fmt}.gguf")


def weights_path(path: str, weights: str = "auto", folder: str | None = None, backend: Backend = CPU) -> str:
    """The GGUF the engine loads for model ``path``: ``path`` itself, or its converted copy
    (made now if the cache has none).

    Raises:
        ValueError: unknown ``weights``. ConfigError: the cache folder is not writable.
        RuntimeError: llama.cpp could not convert the file.
    """
    fmt = target(path, weights, backend, folder)
    if fmt is None:
        return path

    def quantize(tmp: str) -> None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = _TARGETS[fmt]
        params.allow_requantize = True
        params.nthread = len(os.sched_getaffinity(0))
        if llama_cpp.llama_model_quantize(path.encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not convert {path} to {fmt}")

    return cached_copy(path, fmt, quantize, f"converting {path} to {fmt.upper()} once", folder)


def cached_copy(path: str, kind: str, write: Callable[[str], None], says: str, folder: str | None = None) -> str:
    """The ``kind`` copy of GGUF ``path`` in ``folder`` (default :func:`cache_dir`), made now by
    ``write(temporary path)`` if the cache has none (``says`` is logged first): written beside its
    final name and renamed, so a concurrent start sees no file or the whole file; then its
    ``.source`` record, and the stale copies pruned (:func:`remove_stale_copies`). ``kind``: one of
    :data:`COPY_KINDS`.

    Raises:
        ConfigError: the cache folder is not writable. Whatever ``write`` raises.
    """
    folder = folder or cache_dir()
    source = _identity(path)
    out = _copy_path(path, source, kind, folder)
    if os.path.exists(out):
        if "file_type" not in _read_record(out):  # made before the records, or before they held the type
            _record(out, source, file_type(path))
        return out
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".converting-", suffix=".gguf")
    except OSError as e:
        raise ConfigError(f"cannot write converted weights to {folder}: {e.strerror}; set XDG_CACHE_HOME to a "
                          "writable folder, or --weights file") from None
    os.close(fd)
    try:
        log.info("%s: %s", says, out)
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)  # atomic: a concurrent start sees no file or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _record(out, source, file_type(path))
    remove_stale_copies(folder, keep=out)
    return out


def _record(copy: str, source: dict, ftype: int) -> None:
    """Write ``<copy>.source``: the identity of the file ``copy`` was converted from, and its
    ``file_type``; atomically, as engines starting together read it."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(copy), prefix=".recording-")
        with os.fdopen(fd, "w") as f:
            json.dump({**source, "file_type": ftype}, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, copy + SOURCE_SUFFIX)
    except OSError as e:  # a read-only cache still serves its copies; they are only not pruned
        log.warning("cannot record the source of %s: %s", copy, e.strerror)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


#: Bytes of a ``.source`` record read at most (one is about 200).
RECORD_MAX_BYTES = 4096


def _read_record(copy: str) -> dict:
    """The JSON of ``<copy>.source``; empty when there is none or it is not a record: only a
    regular file is read (a FIFO would block the start, a link to ``/dev/zero`` fill memory),
    and at most :data:`RECORD_MAX_BYTES` of it."""
    try:
        fd = os.open(copy + SOURCE_SUFFIX, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            saved = json.loads(os.read(fd, RECORD_MAX_BYTES))
            return saved if isinstance(saved, dict) else {}
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)
    return {}


def _identity(path: str) -> dict:
    """What a copy is made from: the source's real path, size (bytes) and modification time (ns)."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def remove_stale_copies(folder: str, keep: str = "") -> list[str]:
    """Remove the converted copies in ``folder`` (named as :func:`weights_path` names them) whose
    ``.source`` names a file that is gone or changed since, except ``keep`` (the copy just made:
    its source may have changed while it was converted); returns their paths. Copies without a
    ``.source`` (made before the records, for a file no start has asked for since) are left
    alone, and so is what cannot be read or removed (logged). A running engine that maps a
    removed copy keeps it until it exits.
    """
    removed = []
    for record in glob.glob(os.path.join(glob.escape(folder), "*.gguf" + SOURCE_SUFFIX), include_hidden=True):
        copy = record.removesuffix(SOURCE_SUFFIX)
        if copy == keep or not _COPY_NAME.fullmatch(os.path.basename(copy)) or not _stale(copy):
            continue
        try:
            for name in (copy, record):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
        except OSError as e:  # another user's, in a shared temporary folder; a directory
            log.warning("cannot remove the stale copy %s: %s", copy, e.strerror)
            continue
        removed.append(copy)
    return removed


def _stale(copy: str) -> bool:
    """Whether the record of ``copy`` names a source that is gone or differs from when it was
    written (only the fields :func:`_identity` gives are compared); False when there is no such
    record (:func:`_read_record`)."""
    source = _read_record(copy)
    if not source:
        return False  # none, unreadable, or not a record of ours (or one being written)
    try:
        current = _identity(source["path"])
    except (FileNotFoundError, NotADirectoryError):
        return os.path.isfile(copy + SOURCE_SUFFIX)  # the source is gone, unless the record went first
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not a path
    return any(source.get(k) != v for k, v in current.items())
