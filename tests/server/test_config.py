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
