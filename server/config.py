"""Server configuration: flags with environment equivalents, validated at start-up.

Every option is a field of :class:`ServerConfig`, and its metadata names the command-line flag
and the environment variable; the defaults of the engine's share are :class:`EngineConfig`'s. So
each default lives in one place, and the ``--help`` text and the table in docs/configuration.md are checked
against it (``tests/spec/test_docs.py``). The gunicorn config module (``server.gunicorn_conf``)
reads the same variables, so ``gunicorn -c python:server.gunicorn_conf server.wsgi:app`` serves
the same configuration.
"""
from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import NamedTuple
from urllib.parse import urlparse

from engine.config import POLICIES, WEIGHTS, ConfigError, EngineConfig, default_model_path
from server import model_specs
from server.model_specs import ModelSpec

_ENGINE = {f.name: f.default for f in fields(EngineConfig)}


def _option(flag: str, env: str, help_: str, default=MISSING, engine: str | None = None, shown=None):
    """A configuration field: its flag, environment variable and help; an engine setting takes
    its default from :class:`EngineConfig` field ``engine``."""
    if engine is not None:
        default = _ENGINE[engine]
    return field(default=default, metadata={"flag": flag, "env": env, "help": help_, "shown": shown, "engine": engine})


#: A host name (RFC 1123 labels, and ``_``, which container runtimes' names may hold and their
#: DNS resolves) or an IPv4 address written as one.
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def _is_host(host: str) -> bool:
    """Whether ``host`` is a host name, an IPv4 address, or an IPv6 address (with ``:``)."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None


@dataclass(frozen=True)
class ServerConfig:
    """Validated server settings; see each field's help (``inference-server --help``).

    Raises:
        ConfigError: an invalid value; the message is one line naming the option.
    """

    host: str = _option("--host", "HOST", "address to listen on", "127.0.0.1")
    port: int = _option("--port", "PORT", "HTTP port", 8080)
    model_path: str | None = _option("--model", "MODEL_PATH",
                                     "GGUF model file; given more than once, one model each (the environment "
                                     "variable separates them with " + os.pathsep + ")", None,
                                     shown="bundled SmolLM2-135M")
    models_file: str = _option("--models", "MODELS_FILE",
                               "models file (TOML or JSON): several models, each its names, GGUF, chat template, "
                               "kind (generate or embed) and engine settings (docs/models.md)", "", shown="none")
    memory_limit: str = _option("--memory-limit", "MEMORY_LIMIT",
                                "memory the models may take together (bytes, or with a unit: 8GB, 512MiB); "
                                "a set of models whose estimate is over it does not start", "",
                                shown="the machine's available memory")
    chat_template: str = _option("--chat-template", "CHAT_TEMPLATE",
                                 "Jinja chat template file to use instead of the model's (llama-server's "
                                 "--chat-template-file); its tool-call format is read from it", "",
                                 shown="the model's")
    json_separators: str = _option("--json-separators", "JSON_SEPARATORS",
                                   "the separators structured outputs write JSON with, as JSON: between items "
                                   "and after a key (Python's json.dumps separators; docs/api.md)", "",
                                   shown='[", ", ": "]')
    model_id: str = _option("--model-id", "MODEL_ID",
                            "model names clients may send, comma-separated (the first is the default; vLLM's "
                            "--served-model-name); /v1/models lists them all", "",
                            shown="the GGUF's general.name, and local-model")
    max_slots: int = _option("--max-slots", "MAX_SLOTS", "sequences decoded together (KV slots)", engine="max_slots")
    max_seq_len: int = _option("--max-seq-len", "MAX_SEQ_LEN", "tokens per sequence, prompt + generation",
                               engine="max_seq_len")
    kv_cache_tokens: int = _option("--kv-cache-tokens", "KV_CACHE_TOKENS",
                                   "KV cells the running sequences hold together (at least --max-seq-len); when "
                                   "growing sequences run short, the youngest is preempted and requeued",
                                   engine="kv_cache_tokens")
    max_queued: int = _option("--max-queued", "MAX_QUEUED", "requests that may wait beyond the slots; more get 503",
                              engine="max_queued")
    policy: str = _option("--policy", "POLICY", "scheduling policy: " + " | ".join(POLICIES), engine="policy")
    engine_threads: int = _option("--engine-threads", "ENGINE_THREADS",
                                  "llama.cpp compute threads (0: adaptive, up to one per CPU)", engine="n_threads")
    n_batch: int = _option("--n-batch", "N_BATCH", "token budget of one engine step", engine="n_batch")
    prefix_cache_tokens: int = _option("--prefix-cache-tokens", "PREFIX_CACHE_TOKENS",
                                       "most tokens the prefix cache keeps, all tenants together, least "
                                       "recently used out first (0 or --no-prefix-cache: off)",
                                       engine="prefix_cache_tokens")
    weights: str = _option("--weights", "WEIGHTS",
                           "weight format computed with: " + " | ".join(WEIGHTS) + " (auto: a Q4_1 or Q5_1 file is "
                           "converted to Q8_0 once, which llama.cpp multiplies in batches; file: as stored)",
                           engine="weights")
    max_request_extras_bytes: int = _option("--max-request-extras-bytes", "MAX_REQUEST_EXTRAS_BYTES",
                                            "bytes a request may carry beyond numbers and its prompt (its logit_bias); "
                                            "every ring record holds them; a request needing more gets 400",
                                            engine="max_request_extras_bytes")
    deterministic: bool = _option("--deterministic", "DETERMINISTIC",
                                  "greedy output identical whatever the batch and with or without a prefix-cache "
                                  "hit (the flag or 1; CPU only), at the price of slower long prompts",
                                  engine="deterministic", shown="0")
    workers: int = _option("--workers", "WORKERS", "gunicorn worker processes", 2)
    threads: int = _option("--threads", "THREADS",
                           "threads per gunicorn worker: requests it handles at once (0: one per slot and queue "
                           "place of every model, plus 8)", 0)
    max_body_bytes: int = _option("--max-body-bytes", "MAX_BODY_BYTES", "largest request body accepted", 1 << 20)
    max_discard_bytes: int = _option("--max-discard-bytes", "MAX_DISCARD_BYTES",
                                     "most bytes of a refused (413) body read and dropped before the close, so "
                                     "the client reads the 413 instead of a reset", 32 << 20)
    max_messages: int = _option("--max-messages", "MAX_MESSAGES", "most chat messages in one request", 512)
    sse_keepalive_s: float = _option("--sse-keepalive-s", "SSE_KEEPALIVE_S",
                                     "seconds between SSE keep-alive comments while a stream waits (0: none)", 15.0)
    cors_allow_origins: str = _option("--cors-allow-origins", "CORS_ALLOW_ORIGINS",
                                      "origins browsers may call from, comma-separated, or *", "", shown="none")
    tenants_file: str = _option("--tenants", "TENANTS_FILE",
                                "tenant file (JSON or TOML): API keys, priority, weight, limits; SIGHUP reloads it",
                                "", shown="none")
    redis_url: str = _option("--redis-url", "REDIS_URL", "Redis for rate limits, stored responses, projects, keys, "
                             "spend and usage shared across replicas", "", shown="none")
    admin_keys_file: str = _option("--admin-keys-file", "ADMIN_KEYS_FILE",
                                   "file of admin keys, one a line, for the Admin API and /admin (the environment "
                                   "variable ADMIN_KEYS may list more, comma-separated); with any, every request "
                                   "needs a key", "", shown="none")
    control_db: str = _option("--control-db", "CONTROL_DB",
                              "SQLite file of projects, keys, limits, spend and usage without --redis-url",
                              "", shown="$XDG_STATE_HOME/inference-server/control.db")
    prices_file: str = _option("--prices", "PRICES_FILE",
                               "JSON file of prices per model, US dollars per million tokens: "
                               "{\"<model>\": {\"input\": ..., \"cached_input\": ..., \"output\": ...}}",
                               "", shown="none (every token free)")
    response_store_max_entries: int = _option("--response-store-max-entries", "RESPONSE_STORE_MAX_ENTRIES",
                                              "stored responses (/v1/responses, store: true) kept per tenant; the "
                                              "least recently used go first", 1000)
    response_store_max_bytes: int = _option("--response-store-max-bytes", "RESPONSE_STORE_MAX_BYTES",
                                            "bytes of stored responses kept per tenant; the least recently used go "
                                            "first", 64 << 20)
    response_store_ttl_s: float = _option("--response-store-ttl-s", "RESPONSE_STORE_TTL_S",
                                          "seconds a stored response is kept after its last use", 86400.0)
    grpc_port: int = _option("--grpc-port", "GRPC_PORT", "gRPC port of the sidecar (0: no gRPC)", 50051)
    grpc_threads: int = _option("--grpc-threads", "GRPC_THREADS",
                                "gRPC handler threads (0: one per slot and queue place of every model, plus 8)", 0)
    metrics: bool = _option("--no-metrics", "METRICS",
                            "Prometheus metrics from every process at GET /metrics (the flag or 0: none)", True,
                            shown="1")
    metrics_port: int = _option("--metrics-port", "METRICS_PORT",
                                "serve /metrics on this port only, not on the HTTP port (0: on the HTTP port)", 0)
    drain_timeout: float = _option("--drain-timeout", "DRAIN_TIMEOUT",
                                   "seconds running requests get to finish after SIGTERM; then they are ended", 30.0)
    step_log: str = _option("--step-log", "STEP_LOG",
                            "append the engine's step records (JSON lines: the requests each step sampled or "
                            "cancelled) to this file, for debugging", "", shown="none")
    log_prompts: bool = _option("--log-prompts", "LOG_PROMPTS",
                                "write each request's prompt into its JSON log line (the flag or 1)", False, shown="0")

    def __post_init__(self):
        if self.host.startswith("[") and self.host.endswith("]"):  # an IPv6 address as a URL writes it
            object.__setattr__(self, "host", self.host[1:-1])
        if not _is_host(self.host):
            raise ConfigError(f"--host must be a host name or an IP address, got {self.host!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0..65535, got {self.port}")
        if not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"--grpc-port must be 0..65535, got {self.grpc_port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        if self.grpc_port and self.grpc_port == self.port:
            raise ConfigError(f"--grpc-port must differ from --port, got {self.port} for both")
        if self.metrics_port and (self.metrics_port in (self.port, self.grpc_port) or not self.metrics):
            raise ConfigError("--metrics-port must differ from --port and --grpc-port, with metrics on")
        if self.grpc_threads < 0:
            raise ConfigError(f"--grpc-threads must be >= 0, got {self.grpc_threads}")
        for name in ("threads", "max_discard_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("workers", "max_body_bytes", "max_messages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.models_file and (self.model_path or self.model_id or self.chat_template or self.json_separators):
            raise ConfigError("--models declares every model: --model, --model-id, --chat-template and "
                              "--json-separators apply only without it")
        self.separators()
        if self.memory_limit:
            from server.memory import parse_bytes
            parse_bytes(self.memory_limit, "--memory-limit")
        if not 0 <= self.drain_timeout <= 86400:
            raise ConfigError(f"--drain-timeout must be 0..86400 seconds, got {self.drain_timeout}")
        if not 0 <= self.sse_keepalive_s <= 3600:
            raise ConfigError(f"--sse-keepalive-s must be 0..3600, got {self.sse_keepalive_s}")
        for name in ("response_store_max_entries", "response_store_max_bytes", "response_store_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.redis_url:
            check_redis_url(self.redis_url)
        # the engine's share, validated without reading any file (check_files reads them)
        ModelSpec(("",), self.model_paths()[0] if not self.models_file else "", where="").engine_config(
            self._engine_share())

    def address(self, port: int) -> str:
        """``host:port`` as gunicorn's ``bind`` and gRPC's ``add_insecure_port`` take it: an
        IPv6 address (``--host ::1`` or ``[::1]``) in brackets."""
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    @functools.cached_property
    def models(self) -> tuple[ModelSpec, ...]:
        """The served models, the first being the default: the models file's (``--models``), or
        one per ``--model`` (the bundled model without one), named by ``--model-id`` or their
        GGUFs (:mod:`server.model_specs`).

        Raises:
            ConfigError: a models file or a model file that cannot be read, names declared twice.
        """
        if self.models_file:
            return model_specs.load_file(self.models_file, engine_settings())
        return model_specs.from_flags(self.model_paths(), self.model_id, self.chat_template, self.separators())

    def separators(self) -> tuple[str, str] | None:
        """``--json-separators`` read (None without it: the default's).

        Raises:
            ConfigError: not JSON, or not two separators (:func:`server.model_specs.json_separators`).
        """
        if not self.json_separators:
            return None
        try:
            value = json.loads(self.json_separators)
        except ValueError:
            shown = self.json_separators if len(self.json_separators) <= 40 else self.json_separators[:37] + "..."
            raise ConfigError(f'--json-separators must be JSON (as [", ", ":"]), got {shown!r}') from None
        return model_specs.json_separators(value, "--json-separators")

    @property
    def model_ids(self) -> tuple[str, ...]:
        """Every served name of every model, the default model's id first."""
        return tuple(name for spec in self.models for name in spec.names)

    def model_paths(self) -> list[str]:
        """``--model``'s paths (several joined by ``os.pathsep`` in ``MODEL_PATH``), or the
        bundled model's."""
        return [p for p in (self.model_path or "").split(os.pathsep) if p] or [default_model_path()]

    @property
    def capacity(self) -> int:
        """Sequences the engines can hold together: every model's slots and queue places."""
        return sum(self.engine_config(spec).n_mailboxes for spec in self.models)

    @property
    def front_end_threads(self) -> int:
        """``--threads``, or by default one per request the engines can hold (every model's
        slots + queue places) plus 8: each worker alone can hold every request the engines
        admit and still has threads to refuse the rest at once (503) and answer its probes,
        instead of leaving them unseen in its queue. The accept backlog is not a queue anyone
        can see or bound."""
        return self.threads or self.capacity + 8

    @property
    def grpc_handler_threads(self) -> int:
        """``--grpc-threads``, or by default one per request the engines can hold
        (every model's slots + queue places) plus 8 for health checks and refusals."""
        return self.grpc_threads or self.capacity + 8

    @property
    def cors_origins(self) -> tuple[str, ...] | str | None:
        """``--cors-allow-origins`` as Falcon's CORS middleware takes it (None: no CORS)."""
        origins = tuple(o.strip() for o in self.cors_allow_origins.split(",") if o.strip())
        return "*" if "*" in origins else origins or None

    def engine_config(self, spec: ModelSpec | None = None) -> EngineConfig:
        """The engine of ``spec`` (default: the default model): every field declared with
        ``engine=``, under its :class:`EngineConfig` name, then the model's own settings, plus
        its path, metrics and step log (:meth:`ModelSpec.engine_config`)."""
        return (spec or self.models[0]).engine_config(self._engine_share(), metrics=self.metrics,
                                                      step_log=self.step_log)

    def _engine_share(self) -> dict[str, object]:
        """Every field declared with ``engine=``, under its :class:`EngineConfig` name."""
        return {s.engine: getattr(self, name) for name, s in engine_settings().items()}

    def check_files(self) -> None:
        """Raise ConfigError (one line) unless the model, the chat template, the tenant file, the
        admin keys and the prices are usable."""
        from server.tenancy.tenants import Tenants

        from server.control.accounting import Prices
        from server.control.state import ADMIN_KEYS_ENV, load_admin_keys

        for spec in self.models:
            spec.check(self.engine_config(spec))
        Tenants.load(self.tenants_file or None).check_models(self.model_ids)
        load_admin_keys(self.admin_keys_file, os.environ.get(ADMIN_KEYS_ENV, ""))
        Prices.load(self.prices_file).check(self.model_ids, self.prices_file)

    def check_memory(self) -> None:
        """Raise ConfigError (one line naming each model's estimate) when the models would hold
        more memory together than ``--memory-limit`` (default: the memory available now):
        :mod:`server.memory`."""
        from server import memory

        front_ends = self.workers + (1 if self.grpc_port else 0)
        estimates = {spec.id: memory.estimate(self.engine_config(spec), front_ends) for spec in self.models}
        memory.check(estimates, memory.parse_bytes(self.memory_limit, "--memory-limit") if self.memory_limit else None)

    def control_db_path(self) -> str:
        """The SQLite file of the control plane (without Redis)."""
        if self.control_db:
            return self.control_db
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        return os.path.join(state, "inference-server", "control.db")

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce this configuration."""
        return {o.env: str(getattr(self, o.name)) for o in OPTIONS if getattr(self, o.name) is not None}

    @classmethod
    def from_env(cls, environ=os.environ) -> "ServerConfig":
        kwargs = {o.name: _convert(o.type, environ[o.env], f"{o.env} ({o.flag})")
                  for o in OPTIONS if environ.get(o.env, "") != ""}
        return cls(**kwargs)


class Option(NamedTuple):
    """One setting as users see it: field name, flag, environment variable, type, default, help."""

    name: str
    flag: str
    env: str
    type: type
    default: object
    help: str
    shown: str


def _options() -> list[Option]:
    out = []
    for f in fields(ServerConfig):
        m = f.metadata
        typ = str if f.default is None else type(f.default)
        out.append(Option(f.name, m["flag"], m["env"], typ, f.default, m["help"],
                          str(m["shown"] if m["shown"] is not None else f.default)))
    return out


#: Every setting, in ``--help`` order.
OPTIONS = _options()


def engine_settings() -> dict[str, model_specs.Setting]:
    """The engine settings a model may set for itself in a models file: flag field name ->
    its ``EngineConfig`` field and type (every flag declared with ``engine=``)."""
    return {o.name: model_specs.Setting(f.metadata["engine"], o.type)
            for o, f in zip(OPTIONS, fields(ServerConfig)) if f.metadata.get("engine")}


def check_redis_url(url: str) -> None:
    """Raise ConfigError (one line, the password hidden) unless redis-py can use ``url``."""
    import redis

    try:
        parts = urlparse(url)
    except ValueError as e:
        raise ConfigError(f"--redis-url is not a URL: {e}") from None
    shown = url.replace(f":{parts.password}@", ":***@") if parts.password else url
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"--redis-url must be redis://, rediss:// or unix://, got {shown!r}")
    try:
        _ = parts.port  # raises on a port that is not a number in range
        if parts.scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise ValueError("the database must be a number")
        redis.ConnectionPool.from_url(url)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--redis-url {shown!r}: {e}") from None


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _convert(typ, raw: str, what: str):
    if typ is bool:
        if raw.strip().lower() not in _BOOLS:
            raise ConfigError(f"{what} must be 1 or 0 (true or false), got {raw!r}")
        return _BOOLS[raw.strip().lower()]
    try:
        return typ(raw)
    except ValueError:
        raise ConfigError(f"{what} must be {typ.__name__}, got {raw!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inference-server",
        description="Multi-tenant LLM inference server: continuous batching over llama.cpp, "
                    "OpenAI-compatible HTTP API. Every flag has an environment equivalent.")
    for o in OPTIONS:
        if o.type is bool:  # a switch: the flag sets the other value than the default
            p.add_argument(o.flag, dest=o.name, action="store_const", const=str(not o.default), default=None,
                           help=f"{o.help} (env {o.env}; default {o.shown})")
            continue
        p.add_argument(o.flag, dest=o.name, type=str, default=None,
                       action="append" if o.name == "model_path" else "store",  # one model each
                       help=f"{o.help} (env {o.env}; default {o.shown})", metavar=o.type.__name__.upper())
    p.add_argument("--no-prefix-cache", dest="prefix_cache_tokens", action="store_const", const="0",
                   help="reuse no KV cells between requests (same as --prefix-cache-tokens 0)")
    return p


def from_args(argv=None, environ=os.environ) -> ServerConfig:
    """Flags override environment variables, which override defaults.

    Raises:
        ConfigError: an invalid value.
    """
    args = parser().parse_args(argv)
    if args.models_file is not None or args.model_path is not None:  # a flag wins over the other way's variables
        ways = ("MODEL_PATH", "MODEL_ID", "CHAT_TEMPLATE", "JSON_SEPARATORS") if args.models_file is not None \
            else ("MODELS_FILE",)
        environ = {k: v for k, v in environ.items() if k not in ways}
    base = {f.name: getattr(ServerConfig.from_env(environ), f.name) for f in fields(ServerConfig)}
    for o in OPTIONS:
        raw = getattr(args, o.name)
        if isinstance(raw, list):  # --model, given once or more
            raw = os.pathsep.join(raw)
        if raw is not None:
            base[o.name] = _convert(o.type, raw, o.flag)
    return ServerConfig(**base)
