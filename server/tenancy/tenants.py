"""Tenants: who may call, at which priority and weight, within which limits.

The tenant file (``--tenants`` / ``TENANTS_FILE``, JSON or TOML) is a public contract, described
in docs/tenants.md::

    {"tenants": [
      {"id": "team-a", "api_keys": ["key-a1", "key-a2"], "priority": "high", "weight": 2,
       "requests_per_second": {"rate": 5, "burst": 10},
       "tokens_per_second": {"rate": 500, "burst": 2000},
       "max_concurrent": 8, "models": ["local-model"]}
    ]}

Keys are kept only as SHA-256 digests and compared with ``hmac.compare_digest``; a key never
appears in a message this module produces.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.config import ConfigError
from engine.request import Priority

log = logging.getLogger("tenants")


@dataclass(frozen=True)
class Rate:
    """A token bucket's parameters: ``rate`` per second refilled, ``burst`` held at most."""

    rate: float
    burst: float


#: The rate fields of a :class:`Tenant`, none set: no limit.
NO_RATES = {"requests_per_second": None, "tokens_per_second": None, "requests_per_day": None}


@dataclass(frozen=True)
class ModelAccess:
    """Which models a tenant may use, as OpenAI's project model permissions say it: ``mode``
    ``allow_list`` (only the models one of whose names is in ``model_ids``) or ``deny_list``
    (every model but those). A model is one thing whatever name a client calls it by, so any of
    its names listed allows (or denies) all of them."""

    mode: str
    model_ids: tuple[str, ...]

    def permits(self, model_names: tuple[str, ...]) -> bool:
        """Whether the model served under ``model_names`` (every name of that one model) passes."""
        listed = any(name in self.model_ids for name in model_names)
        return listed if self.mode == "allow_list" else not listed


@dataclass(frozen=True)
class Tenant:
    """One tenant. ``index`` is its fair-share identity in the engine (stable across processes
    and reloads: 62 bits of the id's SHA-256, :func:`tenant_index`; 0 is the keyless default
    tenant; a tenant is a project of the control plane, ``server/control/``). A limit of None
    means unlimited. ``priority`` is a ceiling: a request may ask for a
    lower class, never a higher one.
    """

    id: str
    index: int
    priority: Priority = Priority.NORMAL
    weight: float = 1.0
    requests_per_second: Rate | None = None
    tokens_per_second: Rate | None = None
    max_concurrent: int | None = None
    requests_per_day: Rate | None = None
    #: The API key the request came with (``key_...``, never its value; None: no key).
    key_id: str | None = None
    #: The models it may use (None: every model): the tenant file's ``models``, or the project's
    #: model permissions in the control plane. Asked through :meth:`may_use`.
    models: ModelAccess | None = None
    #: A project's rate limits per model (model id -> its ``requests_per_second``,
    #: ``tokens_per_second`` and ``requests_per_day``; a model without any: no limit), as
    #: OpenAI's are per model; None: one set of limits for every model (the tenant file's).
    #: Applied by :meth:`for_model`.
    model_rates: Mapping[str, dict] | None = field(default=None, compare=False, hash=False)
    #: The model whose limits these are (:meth:`for_model`; ""; the tenant's own): its rate
    #: limiter's buckets are that model's.
    scope: str = ""

    def may_use(self, model_names: tuple[str, ...]) -> bool:
        """Whether this tenant may use the model a request names: ``model_names`` is every name
        that model is served under (the request's ``model`` is one of them), since a tenant
        allowed ``local-model`` may call the same model ``SmolLM2-135M-Instruct`` too, and one
        denied it may not get it under another name. Without a list: every model.

        A request for a model it may not use is answered as one for a model that does not
        exist (404 ``model_not_found``, OpenAI's answer), and the model is left out of its
        ``/v1/models``: a tenant learns nothing of the models it cannot use.
        """
        if isinstance(model_names, str):  # one name: a model's other names would be missed
            raise TypeError("may_use takes every name of the model (a tuple), not one name")
        return self.models is None or self.models.permits(model_names)

    def for_model(self, model: str) -> "Tenant":
        """This tenant with the rate limits it has for ``model`` (a model's id) and buckets of
        that model's own: a project's (:attr:`model_rates`); the tenant file's are the same for
        every model, and this is that tenant."""
        if self.model_rates is None:
            return self
        return dataclasses.replace(self, scope=model, **{**NO_RATES, **self.model_rates.get(model, {})})

    def priority_for(self, asked: Priority) -> Priority:
        """The class a request runs at: the one it asked for, capped at the tenant's."""
        return Priority(max(asked, self.priority))

    def share(self, asked: Priority) -> EngineShare:
        """What the engine needs of this tenant for a request that asked for class ``asked``."""
        return EngineShare(self.priority_for(asked), self.index, self.weight, self.max_concurrent)


class EngineShare(NamedTuple):
    """A tenant as the engine sees one of its sequences, its fields named as the keywords of
    :meth:`engine.client.EngineClient.submit`: the class it runs at, its fair-share identity and
    weight (VTC), and the most sequences it may have in flight on this node (None: no limit)."""

    priority: Priority
    tenant: int
    weight: float
    max_concurrent: int | None


DEFAULT_TENANT = Tenant("default", 0)
_NO_KEY = bytes(32)
_FIELDS = {"id", "api_keys", "priority", "weight", "requests_per_second", "tokens_per_second", "max_concurrent",
           "models"}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_id(digest: bytes) -> str:
    """A key's public id: ``key_`` and 16 hex digits of the SHA-256 of its digest (so the id
    tells nothing of the key, and the same key has the same id in every process)."""
    return "key_" + hashlib.sha256(digest).hexdigest()[:16]


def redact(key: str) -> str:
    """A key as the admin API shows it after creation: its first 3 and last 4 characters."""
    return f"{key[:3]}...{key[-4:]}" if len(key) >= 12 else "..."


class Tenants:
    """The loaded tenant file, or the one keyless default tenant when there is none.

    Args:
        tenants: ``[(Tenant, [api key, ...])]``; empty means no file (everyone is ``default``).
        path: the file they came from (for :meth:`reload`).
    """

    def __init__(self, tenants: list[tuple[Tenant, list[str]]], path: str | None = None):
        self.path = path
        self.by_id = {t.id: t for t, _ in tenants}
        self._by_digest = {_digest(k): (_digest(k), dataclasses.replace(t, key_id=key_id(_digest(k))))
                           for t, keys in tenants for k in keys}
        #: Each tenant's keys as the admin API lists them: ``{id: [(key id, redacted value)]}``.
        self.keys_of = {t.id: [(key_id(_digest(k)), redact(k)) for k in keys] for t, keys in tenants}

    @property
    def open(self) -> bool:
        """No tenant file: requests need no key and run as the default tenant."""
        return not self.by_id

    def check_models(self, served: tuple[str, ...]) -> None:
        """Refuse a ``models`` entry that is no name of a served model (``served``: every name of
        every model): a misspelt name would leave its tenant without the model it was meant to
        have, silently. For the master, which alone reads the file before any process takes it:
        at start-up beside the prices' check (``ServerConfig.check_files``) and on SIGHUP before
        the workers are told to reload (``server/gunicorn_conf.py``).

        Raises:
            ConfigError: one line naming the tenant and the entry.
        """
        for tenant in self.by_id.values():
            for i, name in enumerate(tenant.models.model_ids if tenant.models else ()):
                if name not in served:
                    raise ConfigError(f"{self.path or 'tenants file'}: tenant {tenant.id!r}: field models[{i}]: "
                                      f"{name!r} is not a name of a served model (served: {', '.join(served)})")

    @classmethod
    def load(cls, path: str | None) -> "Tenants":
        """Read and validate a tenant file (None: no file).

        Raises:
            ConfigError: one line naming the tenant and the field at fault.
        """
        if not path:
            return cls([])
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"tenants file {path}: {e.strerror}") from None
        kind = "TOML" if path.endswith(".toml") else "JSON"
        try:
            data = tomllib.loads(raw.decode("utf-8")) if kind == "TOML" else json.loads(raw)
        except RecursionError:
            raise ConfigError(f"tenants file {path}: not valid {kind}: nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"tenants file {path}: not valid {kind}: {e}") from None
        tenants = parse(data, path)
        if not tenants:
            raise ConfigError(f"tenants file {path}: no tenants (an empty list would let everyone in without a key; "
                              "leave out --tenants for that)")
        return cls(tenants, path)

    def reload(self) -> "Tenants":
        """The file read again. Raises ConfigError as :meth:`load` (the caller keeps the old)."""
        return self.load(self.path)

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant of ``key``; None for a missing or unknown key (the default tenant when no
        file is loaded). The presented key's digest is compared in constant time."""
        if self.open:
            return DEFAULT_TENANT
        if not key:
            return None
        # Looked up by digest, so the lookup's timing depends on a hash of a hash; the final
        # comparison is constant-time whatever the key.
        digest = _digest(key)
        stored, tenant = self._by_digest.get(digest, (_NO_KEY, None))
        return tenant if hmac.compare_digest(stored, digest) else None


def parse(data, path: str = "tenants file") -> list[tuple[Tenant, list[str]]]:
    """Validate the parsed file. Raises ConfigError naming the tenant and the field."""
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
        raise ConfigError(f"{path}: expected an object with a \"tenants\" array")
    out, ids, keys = [], set(), set()
    for n, entry in enumerate(data["tenants"]):
        where = f"{path}: tenant #{n + 1}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be an object")
        tid = entry.get("id")
        if not isinstance(tid, str) or not tid or not _utf8(tid):
            raise ConfigError(f"{where}: field id must be a non-empty string of text")
        where = f"{path}: tenant {tid!r}"
        if tid in ids:
            raise ConfigError(f"{where}: id is listed twice")
        ids.add(tid)
        unknown = set(entry) - _FIELDS
        if unknown:
            raise ConfigError(f"{where}: unknown field {sorted(unknown)[0]}")
        api_keys = entry.get("api_keys")
        if not isinstance(api_keys, list) or not api_keys:
            raise ConfigError(f"{where}: field api_keys must be a non-empty array of keys")
        for i, k in enumerate(api_keys):
            # A key travels in an HTTP header: printable ASCII without spaces, or it could never match.
            if not isinstance(k, str) or not k or not all("!" <= c <= "~" for c in k):
                raise ConfigError(f"{where}: field api_keys[{i}] must be printable ASCII without spaces")
            if _digest(k) in keys:
                raise ConfigError(f"{where}: field api_keys[{i}] is a key listed twice")
            keys.add(_digest(k))
        priority = "normal" if entry.get("priority") is None else entry["priority"]
        if not (isinstance(priority, str) and priority.upper() in Priority.__members__):
            raise ConfigError(f"{where}: field priority must be high, normal or low")
        priority = Priority[priority.upper()]
        weight = _number(entry.get("weight", 1), f"{where}: field weight", 1e-6, 1e6)
        max_concurrent = entry.get("max_concurrent")
        if max_concurrent is not None and (isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int)
                                           or not 1 <= max_concurrent <= 1_000_000):
            raise ConfigError(f"{where}: field max_concurrent must be an integer in [1, 1000000]")
        tenant = Tenant(tid, tenant_index(tid), priority, weight,
                        _rate(entry, "requests_per_second", where), _rate(entry, "tokens_per_second", where),
                        max_concurrent, models=_models(entry, where))
        out.append((tenant, list(api_keys)))
    return out


def tenant_index(tenant_id: str) -> int:
    """A tenant's identity in the engine and the node's shared state: 62 bits of the id's
    SHA-256, the same in every process and across reloads (0 is the keyless default tenant)."""
    return int.from_bytes(hashlib.sha256(tenant_id.encode("utf-8")).digest()[:8], "big") >> 2 or 1


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate escape
        return False


def _number(value, what: str, lo: float, hi: float) -> float:
    """``value`` as a float in ``[lo, hi]`` (a huge integer is refused, not overflowed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)) or not lo <= value <= hi:
        raise ConfigError(f"{what} must be a number in [{lo:g}, {hi:g}]")
    return float(value)


def _rate(entry: dict, name: str, where: str) -> Rate | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"rate", "burst"}:
        raise ConfigError(f"{where}: field {name} must be {{\"rate\": ..., \"burst\": ...}}")
    # Bounded so every derived figure (Retry-After, TTLs, headers) stays a sane finite number.
    return Rate(_number(value["rate"], f"{where}: field {name}.rate", 1e-6, 1e9),
                _number(value["burst"], f"{where}: field {name}.burst", 1, 1e12))


def _models(entry: dict, where: str) -> ModelAccess | None:
    """The tenant's ``models``: the names of the models it may use (absent: every model)."""
    value = entry.get("models")
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        # an empty list would be a tenant that can use nothing: a mistake, not a policy
        raise ConfigError(f"{where}: field models must be a non-empty array of model names (leave it out for "
                          "every model)")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not name or name != name.strip() or not _utf8(name):
            raise ConfigError(f"{where}: field models[{i}] must be a model's name (non-empty text, without "
                              "spaces around it)")
    return ModelAccess("allow_list", tuple(dict.fromkeys(value)))


def key_of(authorization: str | None, x_tenant_id: str | None) -> str | None:
    """The API key a request carries: ``Authorization: Bearer <key>`` or ``X-Tenant-ID: <key>``."""
    if authorization:
        scheme, *value = authorization.split(None, 1)
        if scheme.lower() == "bearer" and value and value[0].strip():
            return value[0].strip()
    return x_tenant_id.strip() if x_tenant_id and x_tenant_id.strip() else None



class TenantRegistry:
    """The tenants in force in this process: the tenant file's (:meth:`reload`, on SIGHUP,
    replaces them at once, so a request sees either the old file or the new one, and in-flight
    requests keep running), and with a control plane (``server/control/state.py``) its
    projects' keys, the file's winning for a project both name.
    """

    def __init__(self, tenants: Tenants, control=None):
        self.current, self.control = tenants, control

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant of ``key`` (the default tenant while :attr:`open`); None: missing or
        unknown (revoked, expired, its project archived)."""
        if self.open:
            return DEFAULT_TENANT
        if not key:
            return None
        tenant = self.current.authenticate(key) if self.current.by_id else None
        if tenant is None and self.control is not None:
            tenant = self.control.state.authenticate(key)
            if tenant is None and self.control.catch_up():  # a key made a moment ago elsewhere
                tenant = self.control.state.authenticate(key)
        return tenant

    @property
    def open(self) -> bool:
        """Requests need no key: no tenant file, and (with a control plane) no admin keys and
        no project made through the Admin API."""
        return self.current.open if self.control is None else self.control.open

    def reload(self) -> bool:
        """Read the file again; a bad file keeps the tenants in force and logs why."""
        try:
            new = self.current.reload()
        except ConfigError as e:
            log.error("tenant file not reloaded, keeping the previous one: %s", e)
            return False
        except Exception as e:  # noqa: BLE001 - a reload must never take the process down
            log.error("tenant file not reloaded, keeping the previous one: %s", type(e).__name__)
            return False
        self.current = new
        if self.control is not None:
            self.control.replace_file(new)
        log.info("tenant file reloaded: %d tenants", len(new.by_id))
        return True
