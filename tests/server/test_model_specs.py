"""Declaring several models (server/model_specs.py): the models file, ``--model`` given more than
once, the names each model is served under, its engine settings, and the memory the set may take
(server/memory.py). No engine starts here."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from engine.config import EMBED_DEFAULTS, ConfigError


def _file(tmp_path, models, name="models.toml") -> str:
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps({"models": models}))
    else:
        lines = []
        for m in models:
            lines.append("[[models]]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in m.items()]
        path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_models_file_declares_names_kinds_and_engine_settings(tmp_path, model_path, gemma_model_path):
    from server.config import ServerConfig

    path = _file(tmp_path, [{"names": ["chat", "local-model"], "path": model_path, "max_slots": 3},
                            {"path": gemma_model_path, "json_separators": [", ", ":"]},
                            {"names": ["embed"], "path": model_path, "kind": "embed", "pooling": "mean"}])
    config = ServerConfig(models_file=path, max_slots=5)
    chat, gemma, embed = config.models
    assert config.model_ids == ("chat", "local-model", "Gemma-3-270m", "embed")  # a table without names: the GGUF's
    assert config.engine_config(chat).max_slots == 3  # its own setting
    assert config.engine_config(gemma).max_slots == 5  # the server's flag
    engine = config.engine_config(embed)  # the embedding sizes, unless the model sets its own
    assert (engine.kind, engine.pooling) == ("embed", "mean")
    assert {k: getattr(engine, k) for k in EMBED_DEFAULTS} == EMBED_DEFAULTS
    assert chat.chat_template_origin() and gemma.chat_template_origin() is None and embed.chat_template_origin() is None
    assert (chat.json_separators, gemma.json_separators) == ((", ", ": "), (", ", ":"))  # json.dumps' by default
    config.check_files()
    # the same in JSON, relative paths read from the file's folder
    os.symlink(model_path, tmp_path / "m.gguf")
    json_path = _file(tmp_path, [{"names": ["a"], "path": "m.gguf"}], "models.json")
    assert ServerConfig(models_file=json_path).models[0].path == str(tmp_path / "m.gguf")


@pytest.mark.parametrize("models,says", [
    ([], "a non-empty list"),
    ([{"names": ["a"]}], "models[0] in .*: path must be"),
    ([{"names": ["a"], "path": "M", "kind": "rerank"}], "models[0] in .*: kind must be one of generate, embed"),
    ([{"names": ["a"], "path": "M", "pooling": "mean"}], "pooling applies to kind = \"embed\" only"),
    ([{"names": ["a"], "path": "M", "max_slots": "4"}], "max_slots must be int"),
    ([{"names": ["a"], "path": "M", "max_slot": 4}], "unknown key 'max_slot'"),
    ([{"names": [], "path": "M"}], "names must be a non-empty list"),
    ([{"names": ["a"], "path": "M"}, {"names": ["b", "a"], "path": "M"}], "model name 'a' is declared twice"),
    ([{"names": ["a"], "path": "M", "max_slots": 300}], "models[0] in .*: max_slots must be <= 256"),
    ([{"names": ["a"], "path": "M", "json_separators": ", "}], "json_separators must be two strings"),
    ([{"names": ["a"], "path": "M", "json_separators": [", ", ": ", " "]}], "json_separators must be two strings"),
    ([{"names": ["a"], "path": "M", "json_separators": [";", ":"]}], "json_separators: the first must be ','"),
    ([{"names": ["a"], "path": "M", "json_separators": [",", ": x"]}], "json_separators: the second must be ':' with"),
    ([{"names": ["a"], "path": "M", "json_separators": [",.*", ":"]}], "json_separators: the first must be ','"),
    ([{"names": ["a"], "path": "M", "json_separators": ["," + " " * 17, ":"]}], "at most 16 spaces"),
    ([{"names": ["a"], "path": "M", "kind": "embed", "pooling": "mean", "json_separators": [",", ":"]}],
     "json_separators applies to kind = \"generate\" only"),
])
def test_a_bad_models_file_is_one_line_naming_the_model_and_key(tmp_path, model_path, models, says):
    from server.config import ServerConfig

    models = [{k: (model_path if v == "M" else v) for k, v in m.items()} for m in models]
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")) as e:
        config = ServerConfig(models_file=_file(tmp_path, models))
        config.check_files()
    assert "\n" not in str(e.value)


def test_the_models_file_excludes_the_one_model_flags(tmp_path, model_path):
    from server.config import ServerConfig

    path = _file(tmp_path, [{"names": ["a"], "path": model_path}])
    for flag in ({"model_path": model_path}, {"model_id": "x"}, {"chat_template": "t.jinja"},
                 {"json_separators": '[",", ":"]'}):
        with pytest.raises(ConfigError, match="--models declares every model"):
            ServerConfig(models_file=path, **flag)


@pytest.mark.parametrize("value,says", [
    ('[",", ":"]', None), ('[", ", ": "]', None), ('[",\\n", ":\\t"]', None),
    ("', :'", "--json-separators must be JSON"), ('[",", "="]', "--json-separators: the second must be ':'"),
    ("x" * 1000, "must be JSON .* got 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...'$"),
    ('{"item": ","}', "--json-separators must be two strings"),
    ('[", ", ": "]', None),  # given, the default's: with two --model it is refused all the same (below)
])
def test_json_separators_flag(value, says):
    from server.config import from_args

    if says is None:
        assert from_args(["--json-separators", value], environ={}).models[0].json_separators == tuple(json.loads(value))
        return
    with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
        from_args(["--json-separators", value], environ={})


def test_model_given_twice_serves_two_models_named_by_their_files(model_path, gemma_model_path):
    """``--model A --model B``: each model under its GGUF's name, ``local-model`` the first's too;
    the environment carries both (``os.pathsep``); the same file twice has one name twice."""
    from server.config import from_args

    config = from_args(["--model", model_path, "--model", gemma_model_path], environ={})
    assert [m.names for m in config.models] == [("Smollm2-135M-8k-Lc100K-Mix1-Ep2", "local-model"), ("Gemma-3-270m",)]
    assert from_args([], environ=config.to_env()).models == config.models
    for flag in (["--model-id", "x"], ["--json-separators", '[", ", ": "]']):
        with pytest.raises(ConfigError, match="--model-id, --chat-template and --json-separators apply to one model"):
            from_args(["--model", model_path, "--model", gemma_model_path, *flag], environ={}).models
    with pytest.raises(ConfigError, match="declared twice"):
        from_args(["--model", model_path, "--model", model_path], environ={}).models


def test_a_set_of_models_over_the_memory_limit_does_not_start(tmp_path, model_path, gemma_model_path):
    """The estimate (weights, KV memory, compute, processes) of every model against
    ``--memory-limit``: one line naming each model's share; a limit with room passes."""
    from server.config import ServerConfig
    from server.memory import parse_bytes

    path = _file(tmp_path, [{"names": ["a"], "path": model_path}, {"names": ["b"], "path": gemma_model_path}])
    with pytest.raises(ConfigError) as e:
        ServerConfig(models_file=path, memory_limit="1GB").check_memory()
    message = str(e.value)
    assert "more than --memory-limit (1,000 MB)" in message and "a: " in message and "b: " in message, message
    assert "\n" not in message
    ServerConfig(models_file=path, memory_limit="64GiB").check_memory()
    assert parse_bytes("1.5 GB", "x") == 1_500_000_000 and parse_bytes("512MiB", "x") == 512 << 20
    for bad in ("", "lots", "-1GB", "0"):
        with pytest.raises(ConfigError, match="--memory-limit must be a size"):
            ServerConfig(memory_limit=bad or " ")


def test_the_estimate_grows_with_what_the_engine_may_hold(model_path):
    """More KV cells (slots' budget, prefix cache) and more front ends: more memory; an embedding
    engine holds one batch of cells and no logits."""
    from server.config import ServerConfig
    from server.memory import PIECES_BYTES_PER_TOKEN, estimate

    small = estimate(ServerConfig(model_path=model_path, kv_cache_tokens=8192, prefix_cache_tokens=0).engine_config(), 1)
    big = estimate(ServerConfig(model_path=model_path).engine_config(), 3)
    assert big.kv > small.kv and big.weights == small.weights
    # the tokenizer once (the front ends share the master's), and what each may copy of it
    assert big.front_ends - small.front_ends == 2 * PIECES_BYTES_PER_TOKEN * 49152
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) x 2 bytes = 23,040 bytes a cell
    assert small.kv == (8192 + 512) * 23040


def test_an_embedding_engine_counts_logits_only_where_its_graph_has_the_head(model_path, gemma_model_path):
    """SmolLM2 (``llama``) embeds as ``llama-embed``, whose graph has no language-model head: no
    logits; Gemma 3 keeps its head, so every token of a batch is a row of 262,144 logits, twice."""
    from server.config import ServerConfig
    from server.memory import ACTIVATION_FLOATS, estimate

    def compute(path):
        config = ServerConfig(model_path=path).engine_config()
        config = dataclasses.replace(config, kind="embed", n_batch=256, max_seq_len=1024)
        return estimate(config, 1).compute, ACTIVATION_FLOATS * 4 * 256

    smol, per_unit = compute(model_path)
    assert smol == per_unit * 576  # activations only
    gemma, per_unit = compute(gemma_model_path)
    assert gemma == 2 * 4 * 262144 * 1024 + per_unit * 640


def test_a_flag_wins_over_the_other_ways_variables(tmp_path, model_path):
    """``--models`` with ``MODEL_PATH`` (and ``MODEL_ID``) in the environment, as the shipped
    ConfigMap sets them: the flag wins, as flags win everywhere; ``--model`` wins over
    ``MODELS_FILE`` the same way. Server-wide settings are named as flags, not as a model."""
    from server.config import from_args

    path = _file(tmp_path, [{"names": ["a"], "path": model_path}])
    config = from_args(["--models", path], environ={"MODEL_PATH": "/nowhere.gguf", "MODEL_ID": "x",
                                                    "JSON_SEPARATORS": '[",", ":"]'})
    assert config.model_ids == ("a",)
    config = from_args(["--model", model_path, "--model-id", "b"], environ={"MODELS_FILE": path})
    assert config.model_ids == ("b",)
    with pytest.raises(ConfigError, match="--models declares every model"):
        from_args([], environ={"MODELS_FILE": path, "MODEL_PATH": model_path})
    with pytest.raises(ConfigError) as e:
        from_args(["--max-slots", "300"], environ={})
    assert str(e.value).startswith("max_slots must be <= 256")


def test_an_embedding_model_that_cannot_embed_stops_before_start(tmp_path, model_path):
    """SmolLM2 declares no pooling, and its 576 dimensions need a ``max_seq_len`` of 576: both
    found from the GGUF by the master, one line each, before any engine starts."""
    from server.config import ServerConfig

    for extra, says in (({}, "declares no pooling an embedding can use"),
                        ({"pooling": "mean", "max_seq_len": 512, "n_batch": 512}, "576 dimensions, more than")):
        path = _file(tmp_path, [{"names": ["e"], "path": model_path, "kind": "embed", **extra}])
        with pytest.raises(ConfigError, match=says):
            ServerConfig(models_file=path).check_files()
