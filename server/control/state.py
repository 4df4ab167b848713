"""What the control plane holds at one version, as this process uses it (:class:`ControlState`),
and the copy each process keeps current (:class:`ControlPlane`).

A project is a tenant (OpenAI's Admin API). Projects come from two places:

- the tenant file (``--tenants``), read by every process as before (and again on SIGHUP): its
  tenants are listed by the admin API as projects with ``"source": "file"`` and are read-only
  there (409), except their spend limit. **The file wins** for every project it names: it is
  the declared state of a GitOps deployment, and copying it into the shared state would let two
  replicas with different files, or a rolled-back file, overwrite each other.
- the store (``server/control/store.py``): projects made through the API, with their service
  accounts, keys, rate limits, spend limits and model permissions, shared by every replica
  through Redis (or the node's SQLite file). A change is in force in every process within
  :data:`POLL_S` (each process polls the store's version and re-reads the documents when it
  moved).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from engine.config import ConfigError
from engine.request import Priority
from server.control.store import ControlUnavailable, RedisControl, WriteBehind, open_store
from server.tenancy.tenants import ModelAccess, Rate, Tenant, Tenants, tenant_index

log = logging.getLogger("control")

#: The environment variable of admin keys given directly (comma-separated), beside
#: ``--admin-keys-file``: a Secret as an environment variable. Never a flag: a command line is
#: visible to every user of the machine.
ADMIN_KEYS_ENV = "ADMIN_KEYS"
#: Seconds between two polls of the store's version by each process.
POLL_S = 0.5
#: An unknown key makes a process read the store's version at most this often (seconds), so a
#: stream of wrong keys costs the store at most ten reads a second per process.
CATCH_UP_S = 0.1
_NO_KEY = bytes(32)


def rates(limit: dict | None) -> dict:
    """A rate-limit document's limits as ``Tenant`` fields: OpenAI's per-minute and per-day limits
    as token buckets (a limit of ``n`` a minute: burst ``n``, refilled at ``n / 60`` a second);
    0 or absent is no limit."""
    limit = limit or {}

    def rate(name: str, seconds: int) -> Rate | None:
        n = limit.get(name) or 0
        return Rate(n / seconds, n) if n > 0 else None
    return {"requests_per_second": rate("max_requests_per_1_minute", 60),
            "tokens_per_second": rate("max_tokens_per_1_minute", 60),
            "requests_per_day": rate("max_requests_per_1_day", 86400)}


def model_access(permissions: dict | None) -> ModelAccess | None:
    """A model-permissions document (OpenAI's ``mode`` and ``model_ids``) as the ``Tenant``'s
    ``models``; None (no document): every model."""
    if permissions is None:
        return None
    return ModelAccess(permissions["mode"], tuple(permissions["model_ids"]))


@dataclass(frozen=True)
class ControlState:
    """The documents of one version, indexed; and the tenant file's tenants.

    Attributes:
        version: the store's version. docs: ``{"<kind>/<id>": document}``.
        projects: ``{id: project document}``, the file's (``source: file``) and the store's.
        tenants: ``{project id: Tenant}`` of the active projects.
    """

    version: int
    docs: dict
    file: Tenants
    model: str
    projects: dict = field(default_factory=dict)
    tenants: dict = field(default_factory=dict)
    _keys: dict = field(default_factory=dict)

    @classmethod
    def build(cls, version: int, docs: dict, file: Tenants, model: str) -> "ControlState":
        projects, tenants, keys = {}, {}, {}
        per_model: dict[str, dict] = {}  # project id -> {model id: its rate limits as Tenant fields}
        for name, doc in docs.items():
            if name.startswith("rate_limit/"):
                per_model.setdefault(doc["project_id"], {})[doc["model"]] = rates(doc)
        for name, doc in docs.items():
            if name.startswith("project/") and doc["id"] not in file.by_id:
                projects[doc["id"]] = doc
                if doc.get("archived_at") is None:
                    pid = doc["id"]
                    tenants[pid] = Tenant(pid, tenant_index(pid), Priority[doc["priority"].upper()],
                                          doc["weight"], max_concurrent=doc.get("max_concurrent"),
                                          models=model_access(docs.get(f"model_permissions/{pid}")),
                                          model_rates=per_model.get(pid, {}),
                                          **rates(docs.get(f"rate_limit/{pid}/{model}")))
        for tid, tenant in file.by_id.items():
            projects[tid] = {"id": tid, "name": tid, "created_at": 0, "archived_at": None, "source": "file",
                             "priority": tenant.priority.name.lower(), "weight": tenant.weight,
                             "max_concurrent": tenant.max_concurrent, "monthly_token_quota": None}
        for name, doc in docs.items():
            if name.startswith("api_key/") and doc["project_id"] in tenants:
                digest = bytes.fromhex(doc["digest"])
                tenant = tenants[doc["project_id"]]
                keys[digest] = (doc.get("expires_at"), dataclasses.replace(tenant, key_id=doc["id"]))
        return cls(version, docs, file, model, projects, tenants, keys)

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant of a store key (None: unknown, revoked or expired); compared in constant
        time, as the file's keys are."""
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        expires_at, tenant = self._keys.get(digest, (None, None))
        stored = digest if tenant is not None else _NO_KEY
        if not hmac.compare_digest(stored, digest) or tenant is None:
            return None
        if expires_at is not None and time.time() >= expires_at:
            return None
        return tenant

    def doc(self, kind: str, ident: str) -> dict | None:
        return self.docs.get(f"{kind}/{ident}")

    def of_kind(self, kind: str, **match) -> list[dict]:
        """Documents of ``kind`` whose fields equal ``match``, oldest first."""
        out = [d for n, d in self.docs.items() if n.startswith(kind + "/") and
               all(d.get(k) == v for k, v in match.items())]
        return sorted(out, key=lambda d: (d.get("created_at", 0), d.get("id", "")))


class ControlPlane:
    """The store and this process's current :class:`ControlState`, kept current by a daemon
    thread (:meth:`start`) that polls the store's version every :data:`POLL_S`.

    Args:
        store: ``RedisControl`` or ``SqliteControl``. file: the tenant file's tenants.
        model: the served model's id (rate limits are per model). admin_keys: digests of the
            admin keys (empty: the admin API is off).
    """

    def __init__(self, store, file: Tenants, model: str, admin_keys: frozenset[bytes] = frozenset()):
        self.store, self.model, self.admin_keys = store, model, admin_keys
        #: what finished requests write, kept while the store is out (every model's accounting)
        self.writes = WriteBehind(store)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._caught_up = 0.0
        try:
            self.state = ControlState.build(*store.documents(), file, model)
        except ControlUnavailable:  # Redis not up yet: the file's tenants now, the store's at the first poll
            log.warning("control plane: the store cannot be read yet; projects made through the Admin API "
                        "are in force once it can")
            self.state = ControlState.build(-1, {}, file, model)

    @classmethod
    def of(cls, config, file: Tenants) -> "ControlPlane":
        """The control plane of a ``ServerConfig``: Redis with ``--redis-url``, else the node's
        SQLite file; the admin keys of ``--admin-keys-file`` and ``ADMIN_KEYS``; not yet polling
        (:meth:`start`). Raises ConfigError as :func:`load_admin_keys`."""
        store = open_store(config.redis_url, config.control_db_path())
        keys = load_admin_keys(config.admin_keys_file, os.environ.get(ADMIN_KEYS_ENV, ""))
        return cls(store, file, config.model_ids[0], keys)

    def describe(self) -> str:
        """Where the tenants in force come from, for the start-up log line."""
        file, state = self.file, self.state
        stored = [p for p in state.tenants if p not in file.by_id]
        now = time.time()
        keys = sum(1 for name, doc in state.docs.items() if name.startswith("api_key/")
                   and doc["project_id"] in state.tenants and (doc.get("expires_at") or now + 1) > now)
        where = "Redis" if isinstance(self.store, RedisControl) else f"SQLite file {self.store.path}"
        file_keys = sum(len(keys) for keys in file.keys_of.values())
        parts = [f"{len(file.by_id)} projects with {file_keys} keys from the tenant file {file.path}"
                 if file.path else "no tenant file",
                 f"{len(stored)} projects with {keys} keys from {where}",
                 f"Admin API {'on' if self.admin_keys else 'off'} ({len(self.admin_keys)} admin keys)",
                 "requests need no key" if self.open else "every request needs a key"]
        return "; ".join(parts)

    def unserved_models(self, served: tuple[str, ...]) -> list[str]:
        """Lines for the start-up log, one per project whose model permissions or rate limits
        name a model not served now (renamed, or no longer declared): a deny list or a rate
        limit of that name no longer holds anything back, an allow list of only such names
        leaves the project no model."""
        lines = []
        for name, doc in sorted(self.state.docs.items()):
            if name.startswith("model_permissions/"):
                gone = [m for m in doc["model_ids"] if m not in served]
                if gone:
                    lines.append(f"project {name.split('/', 1)[1]}: its model permissions ({doc['mode']}) name "
                                 f"{', '.join(gone)}, which no model is served as now")
            elif name.startswith("rate_limit/") and doc["model"] not in served:
                lines.append(f"project {doc['project_id']}: its rate limit rl-{doc['model']} is of a model not "
                             "served now, and holds nothing back")
        return lines

    @property
    def file(self) -> Tenants:
        return self.state.file

    @property
    def open(self) -> bool:
        """No tenant file, no admin keys and no project in the store: requests need no key."""
        return self.file.open and not self.admin_keys and not self.state.tenants

    def refresh(self) -> ControlState:
        """Read the store again. Raises ControlUnavailable."""
        with self._lock:
            self.state = ControlState.build(*self.store.documents(), self.file, self.model)
            return self.state

    def replace_file(self, file: Tenants) -> None:
        """Take a reloaded tenant file (with the documents as they are)."""
        with self._lock:
            state = self.state
            self.state = ControlState.build(state.version, state.docs, file, self.model)

    def write(self, puts: dict, deletes: tuple = ()) -> ControlState:
        """Change documents in the store and take the new state at once (this process)."""
        self.store.write(puts, deletes)
        return self.refresh()

    def catch_up(self) -> bool:
        """Read the store again now if its version moved since this process's last read (at
        most every :data:`CATCH_UP_S`), so that a key made a moment ago through another process
        or replica serves at once. Returns whether the state changed."""
        now = time.monotonic()
        if now - self._caught_up < CATCH_UP_S:
            return False
        self._caught_up = now
        try:
            if self.store.version() == self.state.version:
                return False
            self.refresh()
            return True
        except ControlUnavailable:  # keep the last state, as the poll does
            return False

    def start(self) -> "ControlPlane":
        threading.Thread(target=self._poll, name="control-poll", daemon=True).start()
        return self

    def _poll(self) -> None:
        failing = False
        while not self._stop.wait(POLL_S):
            self.writes.flush()
            try:
                if self.store.version() != self.state.version:
                    self.refresh()
                failing = False
            except Exception as e:  # noqa: BLE001 - keep the last state; say so once
                if not failing:
                    log.warning("control plane: cannot read the store (%s); keeping the state of version %d",
                                type(e).__name__, self.state.version)
                failing = True

    def is_admin(self, key: str | None) -> bool:
        """Whether ``key`` is an admin key (every admin key compared in constant time)."""
        if not key or not self.admin_keys:
            return False
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        found = False
        for k in self.admin_keys:
            found |= hmac.compare_digest(k, digest)
        return found


def admin_id(key: str) -> str:
    """An admin key's id for the audit log: ``admin_`` and 12 hex digits of a hash of its digest."""
    return "admin_" + hashlib.sha256(hashlib.sha256(key.encode("utf-8")).digest()).hexdigest()[:12]


def load_admin_keys(path: str, env_value: str) -> frozenset[bytes]:
    """Digests of the admin keys in file ``path`` (one a line; blank lines and ``#`` comments
    skipped) and in ``env_value`` (comma-separated).

    Raises:
        ConfigError: the file cannot be read, or a key is not printable ASCII without spaces or
            shorter than 16 characters (one line naming the line, never the key).
    """
    keys: list[tuple[str, str]] = []
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"admin keys file {path}: {getattr(e, 'strerror', None) or e}") from None
        keys += [(f"admin keys file {path}: line {n}", line.strip()) for n, line in enumerate(lines, 1)
                 if line.strip() and not line.strip().startswith("#")]
    if env_value:
        keys += [(f"ADMIN_KEYS: key #{n}", k.strip()) for n, k in enumerate(env_value.split(","), 1) if k.strip()]
    for where, k in keys:
        if len(k) < 16 or not all("!" <= c <= "~" for c in k):
            raise ConfigError(f"{where}: an admin key must be at least 16 printable ASCII characters without spaces")
    if path and not keys:
        raise ConfigError(f"admin keys file {path}: no keys")
    return frozenset(hashlib.sha256(k.encode("utf-8")).digest() for _, k in keys)
