"""Server configuration: flags with environment equivalents, validated at start-up.

Every option is a command-line flag of ``inference-server`` and an environment variable; the
gunicorn config module (``server.gunicorn_conf``) reads the same variables, so
``gunicorn -c python:server.gunicorn_conf server.wsgi:app`` serves the same configuration.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from urllib.parse import urlparse

from engine.config import POLICIES, ConfigError, EngineConfig, check_model_file, default_model_path

# (field, flag, environment variable, type, default, help)
OPTIONS = [
    ("host", "--host", "HOST", str, "127.0.0.1", "address to listen on"),
    ("port", "--port", "PORT", int, 8080, "HTTP port"),
    ("model_path", "--model", "MODEL_PATH", str, None, "GGUF model file"),
    ("model_id", "--model-id", "MODEL_ID", str, "local-model", "model name clients send and /v1/models lists"),
    ("max_slots", "--max-slots", "MAX_SLOTS", int, 16, "sequences decoded together (KV slots)"),
    ("max_seq_len", "--max-seq-len", "MAX_SEQ_LEN", int, 2048, "tokens per sequence, prompt + generation"),
    ("max_queued", "--max-queued", "MAX_QUEUED", int, 64, "requests that may wait beyond the slots; more get 503"),
    ("policy", "--policy", "POLICY", str, "continuous", "scheduling policy: " + " | ".join(POLICIES)),
    ("engine_threads", "--engine-threads", "ENGINE_THREADS", int, 0, "llama.cpp compute threads (0: measured default)"),
    ("n_batch", "--n-batch", "N_BATCH", int, 512, "token budget of one engine step"),
    ("workers", "--workers", "WORKERS", int, 2, "gunicorn worker processes"),
    ("threads", "--threads", "THREADS", int, 32, "threads per gunicorn worker (concurrent connections)"),
    ("max_body_bytes", "--max-body-bytes", "MAX_BODY_BYTES", int, 1 << 20, "largest request body accepted"),
    ("redis_url", "--redis-url", "REDIS_URL", str, "", "Redis for shared rate limits (optional)"),
    ("grpc_port", "--grpc-port", "GRPC_PORT", int, 50051, "gRPC port (0 disables)"),
]


@dataclass(frozen=True)
class ServerConfig:
    """Validated server settings (see :data:`OPTIONS` for meanings and defaults).

    Raises:
        ConfigError: an invalid value; the message is one line naming the option.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    model_path: str | None = None
    model_id: str = "local-model"
    max_slots: int = 16
    max_seq_len: int = 2048
    max_queued: int = 64
    policy: str = "continuous"
    engine_threads: int = 0
    n_batch: int = 512
    workers: int = 2
    threads: int = 32
    max_body_bytes: int = 1 << 20
    redis_url: str = ""
    grpc_port: int = 50051

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0..65535, got {self.port}")
        if not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"--grpc-port must be 0..65535, got {self.grpc_port}")
        for name in ("workers", "threads", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.model_id:
            raise ConfigError("--model-id must not be empty")
        if self.redis_url and urlparse(self.redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"--redis-url must be redis://, rediss:// or unix://, got {self.redis_url!r}")
        self.engine_config()  # validates the engine's share

    def resolved_model_path(self) -> str:
        return self.model_path or default_model_path()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model_path=self.resolved_model_path(), max_slots=self.max_slots,
                            max_seq_len=self.max_seq_len, max_queued=self.max_queued,
                            n_batch=self.n_batch, n_threads=self.engine_threads, policy=self.policy)

    def check_model(self) -> None:
        """Raise ConfigError (one line) unless the model file is a readable GGUF."""
        check_model_file(self.resolved_model_path())

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce this configuration."""
        env = {}
        for name, _, var, _, _, _ in OPTIONS:
            value = getattr(self, name)
            if value is not None:
                env[var] = str(value)
        return env

    @classmethod
    def from_env(cls, environ=os.environ) -> "ServerConfig":
        kwargs = {}
        for name, flag, var, typ, _, _ in OPTIONS:
            if environ.get(var, "") != "":
                kwargs[name] = _convert(typ, environ[var], f"{var} ({flag})")
        return cls(**kwargs)


def _convert(typ, raw: str, what: str):
    try:
        return typ(raw)
    except ValueError:
        raise ConfigError(f"{what} must be {typ.__name__}, got {raw!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inference-server",
        description="Multi-tenant LLM inference server: continuous batching over llama.cpp, "
                    "OpenAI-compatible HTTP API. Every flag has an environment equivalent.")
    for name, flag, var, typ, default, help_ in OPTIONS:
        shown = {"model_path": "bundled SmolLM2-135M", "redis_url": "none"}.get(name, default)
        p.add_argument(flag, dest=name, type=str, default=None,
                       help=f"{help_} (env {var}; default {shown!s})", metavar=typ.__name__.upper())
    return p


def from_args(argv=None, environ=os.environ) -> ServerConfig:
    """Flags override environment variables, which override defaults.

    Raises:
        ConfigError: an invalid value.
    """
    args = parser().parse_args(argv)
    base = {f.name: getattr(ServerConfig.from_env(environ), f.name) for f in fields(ServerConfig)}
    for name, flag, _, typ, _, _ in OPTIONS:
        raw = getattr(args, name)
        if raw is not None:
            base[name] = _convert(typ, raw, flag)
    return ServerConfig(**base)
