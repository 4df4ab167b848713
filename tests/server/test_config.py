"""The server's configuration (server/config.py): every engine option reaches EngineConfig, and
the KV budget refuses what cannot hold one sequence."""
from __future__ import annotations

import pytest

from engine.config import ConfigError


def test_every_engine_option_reaches_the_engine():
    """Each ``--flag`` declared with ``engine=`` arrives in EngineConfig under that name (the
    request-extras bound once never did), and the KV budget refuses what cannot hold one sequence."""
    from dataclasses import fields

    from server.config import ServerConfig, from_args

    engine_fields = [f for f in fields(ServerConfig) if f.metadata.get("engine")]
    assert {f.metadata["engine"] for f in engine_fields} >= {"kv_cache_tokens", "max_request_extras_bytes"}
    defaults = from_args([], environ={})
    for f in engine_fields:
        if isinstance(getattr(defaults, f.name), bool):
            continue  # switches: checked through their own tests
        value = getattr(defaults, f.name)
        changed = {"policy": "fifo", "weights": "file"}.get(f.metadata["engine"], value + 1 if isinstance(value, int)
                                                            else value * 2)
        config = ServerConfig(**{**{g.name: getattr(defaults, g.name) for g in fields(ServerConfig)},
                                 f.name: changed})
        assert getattr(config.engine_config(), f.metadata["engine"]) == changed, f.name
    with pytest.raises(ConfigError, match="kv_cache_tokens must be >= max_seq_len"):
        from_args(["--kv-cache-tokens", "4096"], environ={}).engine_config()


# -- the served model's names and template, read from the GGUF ------------------------------------------
def test_the_model_id_is_drawn_from_the_gguf_and_local_model_stays_an_alias(model_path, gemma_model_path):
    """By default a model is served under its ``general.name`` (each run of spaces one ``-``), then
    ``local-model``; ``--model-id`` replaces both; a file without a name is named by its file."""
    from server.config import ServerConfig
    from server.model_specs import served_name

    assert ServerConfig(model_path=model_path).model_ids == ("Smollm2-135M-8k-Lc100K-Mix1-Ep2", "local-model")
    assert ServerConfig(model_path=gemma_model_path).model_ids == ("Gemma-3-270m", "local-model")
    assert ServerConfig(model_path=gemma_model_path, model_id="gemma, org/gemma,gemma").model_ids == ("gemma",
                                                                                                     "org/gemma")
    assert served_name("/models/my model.gguf", None) == served_name("/models/my model.gguf", "  ") == "my-model"
    assert served_name("/m.gguf", " Llama  3.1\t8B ") == "Llama-3.1-8B"


def test_the_chat_template_comes_from_the_file_or_the_model_or_nowhere(model_path, gemma_model_path):
    from server.config import ServerConfig
    from tests.support.model import GEMMA_TEMPLATE

    assert ServerConfig(model_path=model_path).models[0].chat_template_origin() == "the model's tokenizer.chat_template"
    assert ServerConfig(model_path=gemma_model_path).models[0].chat_template_origin() is None  # a base model
    with_template = ServerConfig(model_path=gemma_model_path, chat_template=GEMMA_TEMPLATE).models[0]
    assert with_template.chat_template_origin() == f"--chat-template {GEMMA_TEMPLATE}"


def _damaged(model_path: str, tmp_path, name: str, edit) -> str:
    data = bytearray(open(model_path, "rb").read(4 << 20))  # the metadata of the bundled model, and more
    path = tmp_path / name
    path.write_bytes(edit(data))
    return str(path)


@pytest.mark.parametrize("name, edit, message", [
    ("empty.gguf", lambda d: b"", "is not a GGUF file"),
    ("text.gguf", lambda d: b"not a model at all", "is not a GGUF file"),
    ("cut.gguf", lambda d: d[:100_000], "is cut short: its GGUF metadata runs past the end of the file"),
    ("v1.gguf", lambda d: d[:4] + b"\x01\x00\x00\x00" + d[8:], "is GGUF version 1; llama.cpp reads versions 2 and 3"),
    ("type.gguf", lambda d: d[:24 + 8 + len(b"general.architecture")] + b"\x63\x00\x00\x00" + d[56:],
     "holds a value of unknown type 99"),
])
def test_a_damaged_model_file_is_one_line_naming_it(model_path, tmp_path, name, edit, message):
    """The model file's metadata is read before anything starts (``server.gguf``): whatever is
    wrong with it is a ConfigError whose one line names the file."""
    from server.config import ServerConfig

    path = _damaged(model_path, tmp_path, name, edit)
    with pytest.raises(ConfigError) as e:
        ServerConfig(model_path=path).check_files()
    assert message in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


def test_a_model_template_that_does_not_compile_is_refused_at_start(model_path, tmp_path):
    """The model's own template is compiled at start as a ``--chat-template`` file is (an unknown
    tag, here), so no worker fails on it; the message says how to give another."""
    from server.config import ServerConfig

    def broken(d: bytearray) -> bytes:
        i = d.find(b"{% for message in messages %}")
        return bytes(d[:i] + b"{% fxr" + d[i + 6:])  # the same length: every offset holds

    path = _damaged(model_path, tmp_path, "broken-template.gguf", broken)
    with pytest.raises(ConfigError, match=r"the model's chat template \(tokenizer.chat_template of .*; give one "
                                          r"that compiles with --chat-template FILE\): line 1: .*'fxr'"):
        ServerConfig(model_path=path).check_files()
