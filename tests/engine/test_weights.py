"""The weight format the engine computes with (engine/llama/weights.py): converted once, cached,
atomically; files llama.cpp already multiplies in batches are left alone."""
from __future__ import annotations

import json
import os
import pathlib
import tempfile

import llama_cpp
import pytest

from engine.config import ConfigError, EngineConfig, default_model_path
from engine.llama.library import cache_dir, file_type
from engine.llama.weights import remove_stale_copies, target, weights_path
from server.config import ServerConfig


def test_auto_converts_the_bundled_q4_1_to_q8_0_once(tmp_path):
    source = default_model_path()
    assert file_type(source) == llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
    out = weights_path(source, "auto", str(tmp_path))
    assert out != source and os.path.dirname(out) == str(tmp_path)
    assert file_type(out) == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    stamp = os.stat(out).st_mtime_ns
    assert weights_path(source, "auto", str(tmp_path)) == out and os.stat(out).st_mtime_ns == stamp  # cached
    # no temporary file left; beside the copy, its source's identity and file type
    assert sorted(p.name for p in tmp_path.iterdir()) == [os.path.basename(out), os.path.basename(out) + ".source"]
    assert json.loads(open(out + ".source").read()) == {
        "path": os.path.realpath(source), "size": os.path.getsize(source), "mtime_ns": os.stat(source).st_mtime_ns,
        "file_type": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1}
    # A Q8_0 file has batched kernels already: auto leaves it as it is; an explicit format converts.
    assert target(out, "auto") is None and weights_path(out, "auto", str(tmp_path)) == out
    assert weights_path(source, "file", str(tmp_path)) == source


def test_auto_takes_the_file_type_from_the_copys_record(tmp_path):
    """A start with a cached copy learns the source's type from the copy's record instead of
    loading the file's vocabulary: a record that says F16 (batched kernels: no conversion) is
    believed, one of another file is not, and one without the type gets it."""
    source = default_model_path()
    out = weights_path(source, "auto", str(tmp_path))
    record = pathlib.Path(out + ".source")
    saved = json.loads(record.read_text())
    record.write_text(json.dumps({**saved, "file_type": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}))
    assert target(source, "auto", folder=str(tmp_path)) is None
    record.write_text(json.dumps({**saved, "size": saved["size"] + 1, "file_type": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}))
    assert target(source, "auto", folder=str(tmp_path)) == "q8_0"
    record.write_text(json.dumps({**saved, "file_type": True}))  # JSON's true is no file type
    assert target(source, "auto", folder=str(tmp_path)) == "q8_0"
    record.write_text(json.dumps({k: v for k, v in saved.items() if k != "file_type"}))  # as made a release ago
    assert weights_path(source, "auto", str(tmp_path)) == out and json.loads(record.read_text()) == saved
    record.unlink()
    os.mkfifo(record)  # read, it would block the start: not a regular file, not read
    assert target(source, "auto", folder=str(tmp_path)) == "q8_0"
    record.unlink()
    record.mkdir()
    assert target(source, "auto", folder=str(tmp_path)) == "q8_0"


def test_the_cache_falls_back_to_a_private_temporary_folder(tmp_path, monkeypatch):
    """A home with no writable cache: the copies go to ``inference-server-<uid>`` in the temporary
    folder, mode 0700, never the shared folder itself, and a start refuses one that is not private."""
    home = tmp_path / "home"
    home.write_text("")  # not a folder: no cache can be made under it
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    private = tmp_path / f"inference-server-{os.getuid()}"
    assert cache_dir() == str(private) and (private.stat().st_mode & 0o777) == 0o700
    private.chmod(0o777)
    with pytest.raises(ConfigError, match="not a folder of this user's alone"):
        cache_dir()


def test_the_file_as_stored_is_served():
    """``--weights file``: the engine computes with the GGUF itself, no copy, and generates."""
    from engine.request import SamplingParams
    from tests.support.servers import inproc_engine

    source = default_model_path()
    config = EngineConfig(model_path=source, max_slots=1, max_seq_len=64, max_queued=1, weights="file")
    with inproc_engine(config) as engine:
        assert engine.model.path == source
        with engine.client.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)) as s:
            assert len([t.id for t in s]) == 4


def test_a_changed_source_file_gets_a_new_copy(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(open(default_model_path(), "rb").read())
    cache = tmp_path / "cache"
    cache.mkdir()
    first = weights_path(str(source), "q8_0", str(cache))
    os.utime(source, ns=(1, 1))  # the file was replaced: its modification time moved
    second = weights_path(str(source), "q8_0", str(cache))
    assert first != second and os.path.exists(second)
    assert not os.path.exists(first) and not os.path.exists(first + ".source")  # no start can ask for it


def test_a_copy_whose_source_is_gone_is_removed_by_the_next_conversion(tmp_path):
    """A new checkout converts its own copy; the old checkout's, deleted since, goes then. A copy
    whose source is still there stays, and so does one made before copies named their source."""
    cache = tmp_path / "cache"
    cache.mkdir()
    old, new = tmp_path / "old.gguf", tmp_path / "new.gguf"
    for path in (old, new):
        path.write_bytes(open(default_model_path(), "rb").read())
    stale = weights_path(str(old), "q8_0", str(cache))
    kept = weights_path(default_model_path(), "q8_0", str(cache))
    unnamed = cache / "earlier.0123456789abcdef.q8_0.gguf"
    unnamed.write_bytes(b"GGUF")
    os.unlink(kept + ".source")  # as made before the records: the next start asking for it writes one
    assert weights_path(default_model_path(), "q8_0", str(cache)) == kept and os.path.exists(kept + ".source")
    old.unlink()
    assert os.path.exists(stale)  # nothing is removed until a conversion
    made = weights_path(str(new), "q8_0", str(cache))
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [os.path.basename(p) + suffix for p in (kept, made) for suffix in ("", ".source")] + [unnamed.name])


def test_only_stale_copies_are_removed_and_nothing_escapes(tmp_path):
    """The sweep removes a copy of this server's naming whose record names a changed or vanished
    file, and nothing else: not the copy just made (its source may change during a long
    conversion), not a file of another naming, not what it cannot read; it raises for none."""
    import json

    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    changed = {"path": str(source), "size": 4, "mtime_ns": 1}
    gone = {"path": str(tmp_path / "gone.gguf"), "size": 4, "mtime_ns": 1}
    cache = tmp_path / "cache"
    cache.mkdir()

    def copy(name: str, record) -> str:
        (cache / name).write_bytes(b"GGUF")
        (cache / f"{name}.source").write_text(record if isinstance(record, str) else json.dumps(record))
        return str(cache / name)

    stale = [copy("a.0123456789abcdef.q8_0.gguf", changed), copy("b.0123456789abcdef.f16.gguf", gone),
             copy("c.0123456789abcdef.q8_0.gguf", {**gone, "path": "/etc/passwd/x"}),
             copy(".hidden.0123456789abcdef.q8_0.gguf", gone)]
    just_made = copy("d.0123456789abcdef.q8_0.gguf", changed)
    others = [copy("mine.gguf", gone), copy("e.0123456789abcdef.q8_0.gguf", "{not json"),
              copy("f.0123456789abcdef.q8_0.gguf", {"size": 4})]
    (cache / "g.0123456789abcdef.q8_0.gguf.source").mkdir()
    assert sorted(remove_stale_copies(str(cache), keep=just_made)) == sorted(stale)
    assert not any(os.path.exists(p) or os.path.exists(p + ".source") for p in stale)
    assert all(os.path.exists(p) and os.path.exists(p + ".source") for p in [just_made, *others])


def test_an_unwritable_cache_folder_is_one_clear_error(tmp_path):
    folder = tmp_path / "not-a-folder"
    folder.write_text("")  # even root cannot create a file inside a file
    with pytest.raises(ConfigError, match="cannot write converted weights to .*Not a directory.*--weights file"):
        weights_path(default_model_path(), "q8_0", str(folder))


def test_unknown_format_is_refused_at_start_up():
    with pytest.raises(ValueError, match="weights must be one of"):
        target(default_model_path(), "q4_1")
    with pytest.raises(ConfigError, match="weights must be one of auto, file, q8_0, bf16, f16, got 'int4'"):
        EngineConfig(weights="int4")
    assert ServerConfig(weights="bf16").engine_config().weights == "bf16"
