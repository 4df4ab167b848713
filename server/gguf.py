"""A GGUF file's metadata (strings and numbers), read by the file format's own layout (the GGUF specification in
the ggml repository) without loading llama.cpp: the gunicorn master reads the model's name and
chat template before any worker starts, so a file whose metadata is cut short is refused there,
in one line.

Layout: ``"GGUF"``, version (u32, 2 or 3: version 1's 32-bit counts are refused by llama.cpp
too), tensor count (u64), key-value count (u64), then each pair: key (a string: u64 length and
UTF-8 bytes), value type (u32), value. An array is its element type (u32), its length (u64) and
its elements. Everything is little-endian (a big-endian file, written for s390x, reads as an
unknown version and is refused).
"""
from __future__ import annotations

import mmap
import os
import struct

from engine.config import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: GGUF value types (``enum gguf_type``): the byte size of each fixed-size one.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: ``struct`` formats of the scalar types: uint8, int8, uint16, int16, uint32, int32, float32,
#: bool, uint64, int64, float64.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Truncated(Exception):
    """The metadata runs past the end of the file (or a length is absurd)."""


class _UnknownType(Exception):
    """A value type no GGUF writer writes: the bytes are not GGUF metadata."""


def metadata_strings(path: str, keys: tuple[str, ...]) -> dict[str, str]:
    """The string values of ``keys`` in the GGUF at ``path`` (a key the file lacks is absent).

    Reads up to the last of ``keys`` (the whole metadata when one is missing: about 0.1 s for a
    262,144-token vocabulary, whose token strings are walked one by one), never the tensors.

    Raises:
        ConfigError: one line naming ``path``: unreadable, not GGUF, a version llama.cpp does not
            read, metadata cut short (a partial download), or one of ``keys`` not a string.
    """
    found = metadata(path, keys)
    for name, value in found.items():
        if not isinstance(value, str):
            raise ConfigError(f"model file {path}: metadata {name} is not a string")
    return found


def metadata(path: str, keys: tuple[str, ...], arrays: bool = False) -> dict[str, str | int | float | bool]:
    """The values of ``keys`` in the GGUF at ``path``: strings and scalars (numbers, booleans),
    and with ``arrays`` an array's length (the vocabulary's size: ``tokenizer.ggml.tokens``);
    a key the file lacks, or an array without ``arrays``, is absent. Errors as
    :func:`metadata_strings`."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 4:
                raise ConfigError(f"model file {path} is not a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _read(data, path, set(keys), arrays)
    except OSError as e:
        raise ConfigError(f"cannot read model file {path}: {e.strerror}") from None


def _read(data: mmap.mmap, path: str, wanted: set[str], arrays: bool = False) -> dict[str, str | int | float | bool]:
    if data[:4] != MAGIC:
        raise ConfigError(f"model file {path} is not a GGUF file")
    found: dict[str, str | int | float | bool] = {}
    try:
        version, _tensors, n_kv = _unpack(data, "<IQQ", 4)
        if version not in VERSIONS:
            raise ConfigError(f"model file {path} is GGUF version {version}; llama.cpp reads versions 2 and 3")
        offset = 24
        for _ in range(n_kv):
            if not wanted - found.keys():
                break
            key, offset = _string(data, offset)
            (kind,), offset = _unpack(data, "<I", offset), offset + 4
            name = key.decode("utf-8", errors="replace")
            if name in wanted and kind == _STRING:
                value, offset = _string(data, offset)
                found[name] = value.decode("utf-8", errors="replace")
            elif name in wanted and kind in _SCALAR:
                (found[name],) = _unpack(data, _SCALAR[kind], offset)
                offset += _FIXED[kind]
            elif name in wanted and kind == _ARRAY and arrays:
                (found[name],) = _unpack(data, "<Q", offset + 4)
                offset = _skip(data, kind, offset)
            else:
                offset = _skip(data, kind, offset)
    except _Truncated:
        raise ConfigError(f"model file {path} is cut short: its GGUF metadata runs past the end of the file "
                          f"({len(data)} bytes); download it again") from None
    except _UnknownType as e:
        raise ConfigError(f"model file {path} is damaged: its GGUF metadata holds a value of unknown type "
                          f"{e}") from None
    return found


def _unpack(data: mmap.mmap, fmt: str, offset: int) -> tuple:
    try:
        return struct.unpack_from(fmt, data, offset)
    except struct.error:
        raise _Truncated() from None


def _string(data: mmap.mmap, offset: int) -> tuple[bytes, int]:
    (n,) = _unpack(data, "<Q", offset)
    end = offset + 8 + n
    if end > len(data):
        raise _Truncated()
    return data[offset + 8:end], end


def _skip(data: mmap.mmap, kind: int, offset: int) -> int:
    """The offset after a value of type ``kind`` at ``offset``."""
    if kind in _FIXED:
        end = offset + _FIXED[kind]
    elif kind == _STRING:
        (n,) = _unpack(data, "<Q", offset)
        end = offset + 8 + n
    elif kind == _ARRAY:
        item, count = _unpack(data, "<IQ", offset)
        offset += 12
        if item in _FIXED:
            end = offset + _FIXED[item] * count
        else:  # strings (a vocabulary) or nested arrays: walked one by one
            for _ in range(count):
                offset = _skip(data, item, offset)
                if offset > len(data):
                    raise _Truncated()
            end = offset
    else:
        raise _UnknownType(kind)
    if end > len(data):
        raise _Truncated()
    return end
