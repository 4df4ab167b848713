"""The Admin API's operations, in OpenAI's shapes (``Project``, ``ProjectServiceAccount``,
``ProjectApiKey``, ``ProjectRateLimit``, ``ProjectSpendLimitResource``,
``ProjectModelPermissions``; OpenAI's OpenAPI document), over the control plane
(``server/control/state.py``). Protocol-neutral: bodies in, OpenAI objects out; the routes are
``server/http/admin.py``'s.

Our fields, in OpenAI's style (listed in ``server/http/openapi.json``):

- on a project: ``priority`` (``high`` | ``normal`` | ``low``, the ceiling of its requests'
  class), ``weight`` (its fair share), ``max_concurrent`` (sequences in flight per replica),
  ``monthly_token_quota`` (input + output tokens a UTC month, for an operator who sets no
  prices), ``source`` (``api`` | ``file``);
- on a service account's creation and a new key: ``expires_in_seconds``; on a key,
  ``expires_at``;
- ``POST .../api_keys/{id}/rotate`` (``grace_period_seconds``): a new key for the same
  service account, the old one working until the grace period ends;
- on a spend limit: ``spent_amount`` and ``reserved_amount`` (cents, this month),
  ``tokens_used`` (this month), ``prices_set`` (whether any price is set: without one, the
  limit cannot fire and ``enforcement.status`` is ``inactive``).

Bounds, so that no caller can grow the state without end: :data:`MAX_PROJECTS` projects
(archived ones included: ``DELETE`` of an archived project, ours, makes room),
:data:`MAX_ACCOUNTS` service accounts and :data:`MAX_KEYS` keys per project (expired keys are
dropped with the next key made), names of at most :data:`MAX_NAME` characters. Each bound is
checked on this process's copy of the state, so requests made at the same moment through
several processes may pass it by as many as they are. A key's value is in the answer that creates it, and nowhere else.
"""
from __future__ import annotations

import hashlib
import math
import secrets
import unicodedata
import time

from engine.errors import InvalidRequest
from engine.request import Priority
from server.api.errors import Conflict, NotFound
from server.api.fields import check_number, shown
from server.control.accounting import Price
from server.control.state import ControlPlane, ControlState
from server.control.store import ControlUnavailable, month_of
from server.tenancy.tenants import key_id, redact

MAX_PROJECTS, MAX_ACCOUNTS, MAX_KEYS, MAX_NAME = 10_000, 100, 100, 256
#: Longest grace period of a rotation, and longest key lifetime, seconds (a year).
MAX_SECONDS = 366 * 86400
NANO_PER_CENT = 10_000_000


def _fields(body: dict, allowed: set[str], where: str = "") -> None:
    """Refuse a field this route does not take (never accepted and ignored)."""
    for name in body:
        if name not in allowed:
            raise InvalidRequest(f"unknown field {where}{name} (this server takes {', '.join(sorted(allowed))})",
                                 where + name)


def _name(body: dict, required: bool) -> str | None:
    value = body.get("name")
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME or \
            any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in value):
        raise InvalidRequest(f"name must be a non-empty string of at most {MAX_NAME} characters, without control "
                             "or format characters", "name")
    return value


def _optional_int(body: dict, name: str, lo: int, hi: int):
    value = body.get(name)
    return None if value is None else check_number(name, value, lo, hi, integer=True)


def _unsupported(body: dict, *names: str) -> None:
    for name in names:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is not supported by this server", name)


def _page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list object over ``items`` (oldest first), from after the item ``after``."""
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise InvalidRequest(f"after: no item with id {shown(after)}", "after")
        items = items[ids.index(after) + 1:]
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


def new_key() -> str:
    """A new API key's value: ``sk-proj-`` and 43 URL-safe characters (256 random bits)."""
    return "sk-proj-" + secrets.token_urlsafe(32)


class Admin:
    """The operations. Each change is written to the store and is in force in this process at
    once, in the others within ``POLL_S``; each returns the OpenAI object and the
    ``(action, target)`` the audit log line names."""

    def __init__(self, control: ControlPlane, price: Price, model_names: tuple[str, ...] = (),
                 model_of: dict[str, str] | None = None, clock=time.time):
        #: the served model's price: a spend limit fires only with one
        self.control, self.price, self.clock = control, price, clock
        #: every name a model is served under: model permissions name served models only
        self.model_names = model_names or (control.model,)
        #: each name's model id (default: the name itself): a project has one rate limit per
        #: model, ``rl-<id>``, which ``rl-<any of its names>`` names too
        self.model_of = model_of or {name: name for name in self.model_names}
        self.model_ids = tuple(dict.fromkeys(self.model_of.values()))

    @property
    def state(self) -> ControlState:
        return self.control.state

    def sync(self) -> None:
        """Read the store again if another process changed it since this one's last poll, so an
        admin request sees every change already answered (read-your-writes across workers and
        replicas; one version read a request)."""
        try:
            if self.control.store.version() != self.control.state.version:
                self.control.refresh()
        except ControlUnavailable:  # keep the last state, as the poll does
            pass

    # projects
    def project(self, project_id: str, writable: bool = False) -> dict:
        doc = self.state.projects.get(project_id)
        if doc is None:
            raise NotFound(f"No project found with id {shown(project_id)}", "project_id")
        if writable and doc.get("source") == "file":
            raise Conflict(f"project {shown(project_id)} is defined by the tenant file; change it there", "project_id")
        return doc

    def project_object(self, doc: dict) -> dict:
        return {"id": doc["id"], "object": "organization.project", "name": doc["name"],
                "created_at": doc["created_at"], "archived_at": doc.get("archived_at"),
                "status": "archived" if doc.get("archived_at") else "active", "source": doc.get("source", "api"),
                "priority": doc["priority"], "weight": doc["weight"], "max_concurrent": doc.get("max_concurrent"),
                "monthly_token_quota": doc.get("monthly_token_quota")}

    def list_projects(self, after: str | None, limit: int, include_archived: bool) -> dict:
        docs = sorted(self.state.projects.values(), key=lambda d: (d["created_at"], d["id"]))
        docs = [d for d in docs if include_archived or not d.get("archived_at")]
        return _page([self.project_object(d) for d in docs], after, limit)

    def _project_settings(self, body: dict, doc: dict) -> dict:
        if "priority" in body:
            p = body["priority"]
            if not (isinstance(p, str) and p.upper() in Priority.__members__):
                raise InvalidRequest(f"priority must be high, normal or low, got {shown(p)}", "priority")
            doc["priority"] = p.lower()
        if "weight" in body:
            doc["weight"] = check_number("weight", body["weight"], 1e-6, 1e6)
        if "max_concurrent" in body:
            doc["max_concurrent"] = _optional_int(body, "max_concurrent", 1, 1_000_000)
        if "monthly_token_quota" in body:
            doc["monthly_token_quota"] = _optional_int(body, "monthly_token_quota", 0, 10 ** 15)
        return doc

    def create_project(self, body: dict) -> tuple[dict, tuple[str, str]]:
        _fields(body, {"name", "residency", "external_key_id", "priority", "weight", "max_concurrent",
                       "monthly_token_quota"})
        _unsupported(body, "residency", "external_key_id")
        name = _name(body, True)
        doc = self._project_settings(body, {"id": "proj_" + secrets.token_hex(12), "name": name,
                                            "created_at": int(self.clock()), "archived_at": None,
                                            "priority": "normal", "weight": 1.0, "max_concurrent": None,
                                            "monthly_token_quota": None})
        if len(self.state.projects) >= MAX_PROJECTS:
            raise Conflict(f"this server holds at most {MAX_PROJECTS} projects, archived ones included; delete "
                           "an archived one (DELETE /v1/organization/projects/{id})", "name")
        self.control.write({f"project/{doc['id']}": doc})
        return self.project_object(doc), ("project.create", doc["id"])

    def modify_project(self, project_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        doc = dict(self.project(project_id, writable=True))
        _fields(body, {"name", "external_key_id", "priority", "weight", "max_concurrent", "monthly_token_quota"})
        _unsupported(body, "external_key_id")
        if body.get("name") is not None:
            doc["name"] = _name(body, True)
        self._project_settings(body, doc)
        self.control.write({f"project/{project_id}": doc})
        return self.project_object(doc), ("project.update", project_id)

    def archive_project(self, project_id: str) -> tuple[dict, tuple[str, str]]:
        """Archived: its keys stop working at once; its usage and spend stay readable."""
        doc = dict(self.project(project_id, writable=True))
        doc["archived_at"] = doc.get("archived_at") or int(self.clock())
        self.control.write({f"project/{project_id}": doc})
        return self.project_object(doc), ("project.archive", project_id)

    def delete_project(self, project_id: str) -> tuple[dict, tuple[str, str]]:
        """An archived project gone with its service accounts, keys and limits (ours; OpenAI
        keeps archived projects forever, which a bounded server cannot). Its usage stays."""
        doc = self.project(project_id, writable=True)
        if not doc.get("archived_at"):
            raise Conflict(f"project {shown(project_id)} is active; archive it first", "project_id")
        owned = [f"{kind}/{d['id']}" for kind in ("service_account", "api_key")
                 for d in self.state.of_kind(kind, project_id=project_id)]
        keys = [d["id"] for d in self.state.of_kind("api_key", project_id=project_id)]
        limits = [n for n, d in self.state.docs.items()
                  if n.startswith("rate_limit/") and d["project_id"] == project_id]
        self.control.write({}, (f"project/{project_id}", f"spend_limit/{project_id}",
                                f"model_permissions/{project_id}", *owned, *limits))
        self._forget(keys)
        return ({"object": "organization.project.deleted", "id": project_id, "deleted": True},
                ("project.delete", project_id))

    # service accounts and keys
    def _account(self, project_id: str, account_id: str) -> dict:
        self.project(project_id)
        doc = self.state.doc("service_account", account_id)
        if doc is None or doc["project_id"] != project_id:
            raise NotFound(f"No service account found with id {shown(account_id)}", "service_account_id")
        return doc

    @staticmethod
    def account_object(doc: dict) -> dict:
        return {"object": "organization.project.service_account", "id": doc["id"], "name": doc["name"],
                "role": doc["role"], "created_at": doc["created_at"]}

    def list_accounts(self, project_id: str, after: str | None, limit: int) -> dict:
        self.project(project_id)
        accounts = self.state.of_kind("service_account", project_id=project_id)
        return _page([self.account_object(d) for d in accounts], after, limit)

    def get_account(self, project_id: str, account_id: str) -> dict:
        return self.account_object(self._account(project_id, account_id))

    def _expired(self, project_id: str) -> tuple[str, ...]:
        """The names of the project's expired keys' documents: dropped with the next key made
        (a rotation leaves its old key behind until its grace period ends)."""
        now = self.clock()
        return tuple(f"api_key/{d['id']}" for d in self.state.of_kind("api_key", project_id=project_id)
                     if d.get("expires_at") is not None and d["expires_at"] <= now)

    def _key_docs(self, project_id: str, account: dict, body: dict, name: str) -> tuple[dict, str]:
        """A new key's document and its value (never for an archived project)."""
        if self.state.projects[project_id].get("archived_at"):
            raise Conflict(f"project {shown(project_id)} is archived", "project_id")
        live = len(self.state.of_kind("api_key", project_id=project_id)) - len(self._expired(project_id))
        if live >= MAX_KEYS:
            raise Conflict(f"a project holds at most {MAX_KEYS} keys; revoke one first", "project_id")
        expires_in = _optional_int(body, "expires_in_seconds", 1, MAX_SECONDS)
        value, now = new_key(), self.clock()
        digest = hashlib.sha256(value.encode()).digest()
        # whole seconds, rounded up: a key lives at least what was asked
        doc = {"id": key_id(digest), "project_id": project_id, "service_account_id": account["id"], "name": name,
               "digest": digest.hex(), "redacted_value": redact(value), "created_at": int(now),
               "expires_at": math.ceil(now + expires_in) if expires_in else None}
        return doc, value

    @staticmethod
    def _created_key(doc: dict, value: str) -> dict:
        return {"object": "organization.project.service_account.api_key", "value": value, "name": doc["name"],
                "created_at": doc["created_at"], "id": doc["id"], "expires_at": doc["expires_at"]}

    def create_account(self, project_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        """A service account with its first key (the value is in this answer only)."""
        project = self.project(project_id, writable=True)
        if project.get("archived_at"):
            raise Conflict(f"project {shown(project_id)} is archived", "project_id")
        _fields(body, {"name", "create_service_account_only", "expires_in_seconds"})
        name = _name(body, True)
        only = body.get("create_service_account_only")
        if only is not None and not isinstance(only, bool):
            raise InvalidRequest("create_service_account_only must be a boolean", "create_service_account_only")
        if len(self.state.of_kind("service_account", project_id=project_id)) >= MAX_ACCOUNTS:
            raise Conflict(f"a project holds at most {MAX_ACCOUNTS} service accounts", "project_id")
        account = {"id": "svc_acct_" + secrets.token_hex(12), "project_id": project_id, "name": name,
                   "role": "member", "created_at": int(self.clock())}
        puts, out = {f"service_account/{account['id']}": account}, {**self.account_object(account), "api_key": None}
        expired = ()
        if not only:
            key, value = self._key_docs(project_id, account, body, name)
            puts[f"api_key/{key['id']}"] = key
            out["api_key"] = self._created_key(key, value)
            expired = self._expired(project_id)
        self.control.write(puts, expired)
        self._forget([n.removeprefix("api_key/") for n in expired])
        return out, ("service_account.create", account["id"])

    def update_account(self, project_id: str, account_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        self.project(project_id, writable=True)
        doc = dict(self._account(project_id, account_id))
        _fields(body, {"name", "role"})
        if body.get("name") is not None:
            doc["name"] = _name(body, True)
        if body.get("role") not in (None, "member"):
            raise InvalidRequest("role: this server has one role for service accounts, member", "role")
        self.control.write({f"service_account/{account_id}": doc})
        return self.account_object(doc), ("service_account.update", account_id)

    def delete_account(self, project_id: str, account_id: str) -> tuple[dict, tuple[str, str]]:
        """The account and every key it holds."""
        self.project(project_id, writable=True)
        self._account(project_id, account_id)
        keys = self.state.of_kind("api_key", service_account_id=account_id)
        self.control.write({}, (f"service_account/{account_id}", *(f"api_key/{k['id']}" for k in keys)))
        self._forget([k["id"] for k in keys])
        return ({"object": "organization.project.service_account.deleted", "id": account_id, "deleted": True},
                ("service_account.delete", account_id))

    def create_account_key(self, project_id: str, account_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        """Another key for a service account (OpenAI's ``CreateProjectServiceAccountApiKeyBody``)."""
        self.project(project_id, writable=True)
        account = self._account(project_id, account_id)
        _fields(body, {"name", "scopes", "expires_in_seconds"})
        if body.get("scopes") is not None:
            raise InvalidRequest("scopes: this server's keys have one scope, the project's routes", "scopes")
        key, value = self._key_docs(project_id, account, body, _name(body, False) or account["name"])
        expired = self._expired(project_id)
        self.control.write({f"api_key/{key['id']}": key}, expired)
        self._forget([n.removeprefix("api_key/") for n in expired])
        return self._created_key(key, value), ("api_key.create", key["id"])

    def _last_used(self, docs: list[dict]) -> dict[str, int | None]:
        """``last_used_at`` of keys (to the minute); none while the store cannot be read."""
        try:
            return self.control.store.last_used([d["id"] for d in docs])
        except ControlUnavailable:
            return {}

    def key_object(self, doc: dict, last_used: int | None = None) -> dict:
        account = self.state.doc("service_account", doc["service_account_id"]) or {}
        owner = {"id": doc["service_account_id"], "name": account.get("name", doc["name"]),
                 "created_at": account.get("created_at", doc["created_at"]), "role": "member"}
        expired = doc.get("expires_at") is not None and self.clock() >= doc["expires_at"]
        return {"object": "organization.project.api_key", "redacted_value": doc["redacted_value"], "name": doc["name"],
                "created_at": doc["created_at"], "last_used_at": last_used, "id": doc["id"],
                "owner_project_access": "inactive" if expired else "active",
                "owner": {"type": "service_account", "service_account": owner}, "expires_at": doc.get("expires_at")}

    def _file_keys(self, project_id: str) -> list[dict]:
        return [{"id": kid, "redacted_value": red, "name": "tenant file", "created_at": 0,
                 "service_account_id": "tenants_file", "expires_at": None}
                for kid, red in self.state.file.keys_of.get(project_id, [])]

    def list_keys(self, project_id: str, after: str | None, limit: int, access: str | None = None) -> dict:
        """``access``: only keys whose ``owner_project_access`` is this (``active``, ``inactive``:
        expired)."""
        project = self.project(project_id)
        docs = self._file_keys(project_id) if project.get("source") == "file" else \
            self.state.of_kind("api_key", project_id=project_id)
        if access not in (None, "active", "inactive"):
            raise InvalidRequest(f"owner_project_access must be active or inactive, got {shown(access)}",
                                 "owner_project_access")
        used = self._last_used(docs)
        keys = [self.key_object(d, used.get(d["id"])) for d in docs]
        return _page([k for k in keys if access is None or k["owner_project_access"] == access], after, limit)

    def _key(self, project_id: str, api_key_id: str) -> dict:
        project = self.project(project_id)
        docs = self._file_keys(project_id) if project.get("source") == "file" else \
            [d for d in [self.state.doc("api_key", api_key_id)] if d and d["project_id"] == project_id]
        for doc in docs:
            if doc["id"] == api_key_id:
                return doc
        raise NotFound(f"No API key found with id {shown(api_key_id)}", "api_key_id")

    def get_key(self, project_id: str, api_key_id: str) -> dict:
        doc = self._key(project_id, api_key_id)
        return self.key_object(doc, self._last_used([doc]).get(api_key_id))

    def delete_key(self, project_id: str, api_key_id: str) -> tuple[dict, tuple[str, str]]:
        """Revoked: refused within ``POLL_S`` by every process of every replica."""
        self.project(project_id, writable=True)
        self._key(project_id, api_key_id)
        self.control.write({}, (f"api_key/{api_key_id}",))
        self._forget([api_key_id])
        return ({"object": "organization.project.api_key.deleted", "id": api_key_id, "deleted": True},
                ("api_key.delete", api_key_id))

    def _forget(self, key_ids: list[str]) -> None:
        try:
            self.control.store.forget(key_ids)
        except ControlUnavailable:  # a stale last use of a revoked key: harmless
            pass

    def rotate_key(self, project_id: str, api_key_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        """A new key for the old one's service account; the old one expires after
        ``grace_period_seconds`` (default 0: at once), or at its own expiry if sooner."""
        self.project(project_id, writable=True)
        old = dict(self._key(project_id, api_key_id))
        _fields(body, {"grace_period_seconds", "expires_in_seconds"})
        grace = _optional_int(body, "grace_period_seconds", 0, MAX_SECONDS) or 0
        account = self._account(project_id, old["service_account_id"])
        key, value = self._key_docs(project_id, account, body, old["name"])
        ends = math.ceil(self.clock() + grace)
        old["expires_at"] = ends if old.get("expires_at") is None else min(old["expires_at"], ends)
        expired = tuple(n for n in self._expired(project_id) if n != f"api_key/{api_key_id}")
        self.control.write({f"api_key/{key['id']}": key, f"api_key/{api_key_id}": old}, expired)
        self._forget([n.removeprefix("api_key/") for n in expired])
        return self._created_key(key, value), ("api_key.rotate", api_key_id)

    # rate limits
    def rate_limit_object(self, project_id: str, model: str) -> dict:
        """The rate limit of ``model`` (a model's id) for the project; a file tenant's are its
        file's per-second buckets as per-minute figures, the same for every model (0: none)."""
        doc = self.state.doc("rate_limit", f"{project_id}/{model}") or {}
        file_tenant = self.state.file.by_id.get(project_id)
        if file_tenant is not None:
            doc = {"max_requests_per_1_minute": round(file_tenant.requests_per_second.rate * 60)
                   if file_tenant.requests_per_second else 0,
                   "max_tokens_per_1_minute": round(file_tenant.tokens_per_second.rate * 60)
                   if file_tenant.tokens_per_second else 0}
        return {"object": "project.rate_limit", "id": f"rl-{model}", "model": model,
                "max_requests_per_1_minute": doc.get("max_requests_per_1_minute", 0),
                "max_tokens_per_1_minute": doc.get("max_tokens_per_1_minute", 0),
                "max_requests_per_1_day": doc.get("max_requests_per_1_day", 0)}

    def list_rate_limits(self, project_id: str, after: str | None, limit: int) -> dict:
        self.project(project_id)
        return _page([self.rate_limit_object(project_id, model) for model in self.model_ids], after, limit)

    def update_rate_limit(self, project_id: str, rate_limit_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        """Per-minute and per-day limits of the model (0: none), in force without a reload."""
        self.project(project_id, writable=True)
        model = self.model_of.get(rate_limit_id.removeprefix("rl-")) if rate_limit_id.startswith("rl-") else None
        if model is None:
            raise NotFound(f"No rate limit found with id {shown(rate_limit_id)} (this server's: "
                           f"{', '.join(f'rl-{m}' for m in self.model_ids)})", "rate_limit_id")
        names = ("max_requests_per_1_minute", "max_tokens_per_1_minute", "max_requests_per_1_day")
        _fields(body, set(names) | {"max_images_per_1_minute", "max_audio_megabytes_per_1_minute",
                                    "batch_1_day_max_input_tokens"})
        _unsupported(body, "max_images_per_1_minute", "max_audio_megabytes_per_1_minute",
                     "batch_1_day_max_input_tokens")
        name = f"rate_limit/{project_id}/{model}"
        doc = dict(self.state.docs.get(name) or {"project_id": project_id, "model": model})
        for n in names:
            if n in body:
                doc[n] = _optional_int(body, n, 0, 10 ** 12) or 0
        self.control.write({name: doc})
        return self.rate_limit_object(project_id, model), ("rate_limit.update", project_id)

    # spend limits
    def spend_object(self, project_id: str) -> dict:
        doc = self.state.doc("spend_limit", project_id)
        spend = self.control.store.spend(project_id, month_of(self.clock()))
        prices_set = self.price != Price()
        out = {"object": "project.spend_limit", "threshold_amount": doc["threshold_amount"] if doc else 0,
               "currency": "USD", "interval": "month",
               "enforcement": {"status": "enforcing" if doc and prices_set else "inactive"},
               "spent_amount": spend.spent / NANO_PER_CENT, "reserved_amount": spend.reserved / NANO_PER_CENT,
               "tokens_used": spend.tokens, "prices_set": prices_set}
        return out

    def get_spend_limit(self, project_id: str) -> dict:
        self.project(project_id)
        return self.spend_object(project_id)

    def update_spend_limit(self, project_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        self.project(project_id)  # a file project's spend limit is set here too
        _fields(body, {"threshold_amount", "currency", "interval"})
        for name, value in (("currency", "USD"), ("interval", "month")):
            if body.get(name) != value:
                raise InvalidRequest(f"{name} must be {value!r}, got {shown(body.get(name))}", name)
        if "threshold_amount" not in body:
            raise InvalidRequest("threshold_amount is required (cents a month)", "threshold_amount")
        amount = check_number("threshold_amount", body["threshold_amount"], 1, 10 ** 12, integer=True)
        self.control.write({f"spend_limit/{project_id}": {"project_id": project_id, "threshold_amount": amount}})
        return self.spend_object(project_id), ("spend_limit.update", project_id)

    def delete_spend_limit(self, project_id: str) -> tuple[dict, tuple[str, str]]:
        self.project(project_id)
        if self.state.doc("spend_limit", project_id) is None:
            raise NotFound(f"project {shown(project_id)} has no spend limit", "project_id")
        self.control.write({}, (f"spend_limit/{project_id}",))
        return {"object": "project.spend_limit.deleted", "deleted": True}, ("spend_limit.delete", project_id)

    # model permissions
    def model_permissions_object(self, project_id: str) -> dict:
        """OpenAI's ``ProjectModelPermissions``: the file's ``models`` for a file project (an
        allow list), else the stored document; without either, every model (an empty deny list)."""
        file_tenant = self.state.file.by_id.get(project_id)
        if file_tenant is not None:
            access = file_tenant.models
            doc = {"mode": access.mode, "model_ids": access.model_ids} if access else None
        else:
            doc = self.state.doc("model_permissions", project_id)
        doc = doc or {"mode": "deny_list", "model_ids": []}
        return {"object": "project.model_permissions", "mode": doc["mode"], "model_ids": list(doc["model_ids"])}

    def get_model_permissions(self, project_id: str) -> dict:
        self.project(project_id)
        return self.model_permissions_object(project_id)

    def update_model_permissions(self, project_id: str, body: dict) -> tuple[dict, tuple[str, str]]:
        """The models the project may use (``allow_list``) or may not (``deny_list``), by any of
        their served names; in force without a reload. Each id must be a served name (a
        misspelt one would allow or deny nothing); an empty allow list is refused (a project that
        can use no model; archive it instead)."""
        self.project(project_id, writable=True)
        _fields(body, {"mode", "model_ids"})
        mode = body.get("mode")
        if mode not in ("allow_list", "deny_list"):
            raise InvalidRequest(f"mode must be allow_list or deny_list, got {shown(mode)}", "mode")
        ids = body.get("model_ids")
        if not isinstance(ids, list):
            raise InvalidRequest(f"model_ids must be an array of model ids, got {shown(ids)}", "model_ids")
        for i, name in enumerate(ids):
            if not isinstance(name, str) or name not in self.model_names:
                raise InvalidRequest(f"model_ids[{i}]: {shown(name)} is not a model served here (this server "
                                     f"serves {', '.join(self.model_names)})", f"model_ids[{i}]")
        if mode == "allow_list" and not ids:
            raise InvalidRequest("model_ids: an empty allow_list would let the project use no model (archive it "
                                 "to stop its keys; DELETE the model permissions for every model)", "model_ids")
        doc = {"project_id": project_id, "mode": mode, "model_ids": list(dict.fromkeys(ids))}
        self.control.write({f"model_permissions/{project_id}": doc})
        return self.model_permissions_object(project_id), ("model_permissions.update", project_id)

    def delete_model_permissions(self, project_id: str) -> tuple[dict, tuple[str, str]]:
        """Back to every model (whether or not the project had permissions set: the route only
        resets)."""
        self.project(project_id, writable=True)
        if self.state.doc("model_permissions", project_id) is not None:
            self.control.write({}, (f"model_permissions/{project_id}",))
        return ({"object": "project.model_permissions.deleted", "deleted": True},
                ("model_permissions.delete", project_id))
