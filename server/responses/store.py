"""The Responses API's store: what ``store: true`` keeps of a response so that
``previous_response_id`` can continue it and ``GET``/``DELETE /v1/responses/{id}`` can find it.

Each entry is one JSON document (the response object, its input items and the conversation's
chat messages up to and including this response's output), keyed by ``(tenant, response id)``:
a tenant sees only its own entries, and another tenant's id is as unknown as one never made.

Bounds, per tenant (``StoreLimits``, from ``--response-store-*``): at most ``max_entries``
entries and ``max_bytes`` bytes of documents, and an entry not used (written or read) for
``ttl_s`` seconds is gone. When a write goes over a bound, the least recently used entries go
first. Per tenant so that one tenant's traffic never evicts another's conversations.

Two backends with the same rules:

- :class:`LocalStore` (no ``--redis-url``): SQLite (Python's ``sqlite3``), one database file
  per node that every gunicorn worker of the node opens (the master creates it, see
  ``server/gunicorn_conf.py``), so a continuation reaches the same store whichever worker
  takes it; ``:memory:`` in-process (tests' in-process app).
- :class:`RedisStore` (``--redis-url``): shared by every replica. Keys under the tenant's hash tag
  (``responses:{<tenant>}:...``, as the rate limiter's), so one tenant's keys share a Redis
  Cluster slot and its Lua scripts are atomic: the entry (``PX`` ttl, renewed on read), a
  sorted set of ids by last use, a hash of sizes and their total, trimmed by the script that
  writes.

Redis never makes a request fail with a 5xx: timeouts of 50 ms and no retries as the rate
limiter's (``server/tenancy/ratelimit.py``); the first failure opens a circuit breaker that
probes in the background. While Redis is down :meth:`RedisStore.put` raises
:class:`StoreUnavailable` (the answer is still given, with ``x-response-stored: false``) and so
do reads (``previous_response_id``, ``GET``: a 424, never a guess).
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote

import redis

from engine.errors import RequestError
from server.tenancy.redis_link import Breaker, fast_redis

log = logging.getLogger("responses")


class ResponseNotFound(RequestError):
    """No stored response with this id for this tenant (HTTP 404): never made, not stored,
    deleted, evicted, expired, or another tenant's."""

    code = "not_found"


class StoreUnavailable(RequestError):
    """The store could not be read or written (Redis down; HTTP 424 Failed Dependency)."""

    code = "store_unavailable"


@dataclass(frozen=True)
class StoreLimits:
    """Per-tenant bounds: ``max_entries`` responses, ``max_bytes`` bytes of stored JSON,
    ``ttl_s`` seconds since an entry's last use (all > 0)."""

    max_entries: int = 1000
    max_bytes: int = 64 << 20
    ttl_s: float = 86400.0


def previous(store, tenant: str, response_id: str) -> dict:
    """The stored document a continuation continues (``previous_response_id``), from ``store``
    (a :class:`LocalStore` or :class:`RedisStore`).

    Raises:
        ResponseNotFound, StoreUnavailable: naming ``previous_response_id``.
    """
    try:
        return store.get(tenant, response_id)
    except ResponseNotFound:
        raise ResponseNotFound(f"Previous response with id {response_id!r} not found.",
                               "previous_response_id") from None
    except StoreUnavailable as e:
        raise StoreUnavailable(e.message, "previous_response_id") from None


def _missing(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(f"No response found with id {response_id!r}", "response_id")


class _Transaction:
    """``with``: one SQLite write transaction (``BEGIN IMMEDIATE`` .. ``COMMIT``, ``ROLLBACK``
    on an error), under ``lock`` when the connection is shared by threads."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock | None):
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        if self.lock is not None:
            self.lock.acquire()
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, *_) -> None:
        try:
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            if self.lock is not None:
                self.lock.release()


#: The environment variable naming the node's response store (SQLite): a file in a private
#: directory the master creates (``server/gunicorn_conf.py``), which every worker opens
#: (``server/http/worker_app.py``; a continuation may reach any of them).
RESPONSES_DB_ENV = "INFERENCE_RESPONSES_DB"
# How long a connection waits for another's write lock. Writes are a few rows, but a worker
# may be descheduled while it holds the lock on a busy node.
_BUSY_TIMEOUT_S = 5.0
_SCHEMA = ("CREATE TABLE IF NOT EXISTS responses (tenant TEXT, id TEXT, doc TEXT, bytes INTEGER, "
           "used REAL, PRIMARY KEY (tenant, id))",
           "CREATE INDEX IF NOT EXISTS responses_lru ON responses (tenant, used)")


def create_database(path: str) -> None:
    """Make the node's database file at ``path`` (or check the one there): the table, and the
    WAL journal mode, which the file keeps, so that readers never wait for the writer.

    Called once by the gunicorn master before it forks a worker (``server/gunicorn_conf.py``).
    The switch to WAL needs the file to itself: when each worker switched a new file as it
    booted, two booting together could fail one of them with "database is locked" (CI did).
    Raises ``sqlite3.Error`` when the file cannot be made or is not such a database."""
    db = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        for statement in _SCHEMA:
            db.execute(statement)
    finally:
        db.close()


class LocalStore:
    """The node's store in SQLite (see the module). ``path``: a database file made by
    :func:`create_database`, or ``:memory:`` for this process only. ``clock``: wall-clock seconds.

    Thread-safe: one connection per thread; SQLite's file locks order the node's processes
    (WAL journal, a 5 s busy timeout). Raises ``FileNotFoundError`` when ``path`` is missing."""

    available = True  # a local file is always there

    def __init__(self, path: str, limits: StoreLimits, clock=time.time):
        self.path, self.limits, self.clock = path, limits, clock
        self._local = threading.local()
        self._shared, self._lock = None, None
        if path == ":memory:":  # one connection for every thread: there is no file to share
            self._shared = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._lock = threading.Lock()
            for statement in _SCHEMA:
                self._shared.execute(statement)
        elif not os.path.isfile(path):  # a worker opens what its master made, never a new file
            raise FileNotFoundError(f"no response store at {path} (server.responses.store.create_database)")

    def _connection(self) -> _Transaction:
        if self._shared is not None:
            return _Transaction(self._shared, self._lock)
        db = getattr(self._local, "db", None)
        if db is None:  # WAL is the file's own mode (create_database): nothing to switch here
            db = self._local.db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
            db.execute("PRAGMA synchronous=OFF")  # a node's store does not outlive the node
        return _Transaction(db, None)

    def put(self, tenant: str, response_id: str, doc: dict) -> None:
        """Store ``doc`` under ``(tenant, response_id)``, then evict the tenant's expired
        entries and, least recently used first, those over the bounds."""
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
        now, lim = self.clock(), self.limits
        with self._connection() as db:
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                       (tenant, response_id, text, len(text.encode()), now))
            db.execute("DELETE FROM responses WHERE tenant = ? AND used < ?", (tenant, now - lim.ttl_s))
            count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses WHERE tenant = ?",
                                      (tenant,)).fetchone()
            if count > lim.max_entries or total > lim.max_bytes:
                doomed = []
                for rid, size in db.execute("SELECT id, bytes FROM responses WHERE tenant = ? ORDER BY used",
                                            (tenant,)):
                    if count <= lim.max_entries and total <= lim.max_bytes:
                        break
                    doomed.append((tenant, rid))
                    count, total = count - 1, total - size
                db.executemany("DELETE FROM responses WHERE tenant = ? AND id = ?", doomed)

    def get(self, tenant: str, response_id: str) -> dict:
        """The document, its last use renewed. Raises ResponseNotFound."""
        now = self.clock()
        with self._connection() as db:
            row = db.execute("SELECT doc FROM responses WHERE tenant = ? AND id = ? AND used >= ?",
                             (tenant, response_id, now - self.limits.ttl_s)).fetchone()
            if row is not None:
                db.execute("UPDATE responses SET used = ? WHERE tenant = ? AND id = ?", (now, tenant, response_id))
        if row is None:
            raise _missing(response_id)
        return json.loads(row[0])

    def delete(self, tenant: str, response_id: str) -> None:
        """Remove it. Raises ResponseNotFound when there was none."""
        with self._connection() as db:
            gone = db.execute("DELETE FROM responses WHERE tenant = ? AND id = ? AND used >= ?",
                              (tenant, response_id, self.clock() - self.limits.ttl_s)).rowcount
        if not gone:
            raise _missing(response_id)

    def usage(self, tenant: str) -> tuple[int, int]:
        """``(entries, bytes)`` the tenant holds now (expired entries not yet evicted included)."""
        with self._connection() as db:
            return tuple(db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses WHERE tenant = ?",
                                    (tenant,)).fetchone())


# KEYS: entry, lru (zset id -> last use ms), sizes (hash id -> bytes), total (bytes of all).
# ARGV: id, document, now ms, ttl ms, max entries, max bytes. Returns the entries kept.
_PUT = """
local id, doc, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local max_entries, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6])
local prefix = string.sub(KEYS[1], 1, string.len(KEYS[1]) - string.len(id))
local total = tonumber(redis.call('GET', KEYS[4]) or '0') - tonumber(redis.call('HGET', KEYS[3], id) or '0')
local function forget(old)
  total = total - tonumber(redis.call('HGET', KEYS[3], old) or '0')
  redis.call('ZREM', KEYS[2], old)
  redis.call('HDEL', KEYS[3], old)
  redis.call('DEL', prefix .. old)
end
-- entries unused for ttl have expired on their own: forget them
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - ttl))) do forget(old) end
redis.call('SET', KEYS[1], doc, 'PX', ttl)
redis.call('ZADD', KEYS[2], now, id)
redis.call('HSET', KEYS[3], id, string.len(doc))
total = total + string.len(doc)
local count = redis.call('ZCARD', KEYS[2])
while count > max_entries or total > max_bytes do  -- least recently used first
  forget(redis.call('ZRANGE', KEYS[2], 0, 0)[1])
  count = count - 1
end
redis.call('SET', KEYS[4], total, 'PX', ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
return count
"""
# KEYS: entry, lru, sizes, total. ARGV: id, now ms, ttl ms. The document, its last use renewed.
_GET = """
local doc = redis.call('GET', KEYS[1])
if doc then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
end
return doc
"""
# KEYS: entry, lru, sizes, total. ARGV: id. 1 when it was there.
_DELETE = """
local gone = redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then  -- a DECRBY of a missing total would create it with no expiry
  redis.call('DECRBY', KEYS[4], tonumber(size))
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return gone
"""


class RedisStore:
    """The replicas' store in Redis (see the module). ``url``: as ``--redis-url``.

    Raises (every method): StoreUnavailable while Redis does not answer."""

    def __init__(self, url: str, limits: StoreLimits):
        self.limits = limits
        self.redis = fast_redis(url)
        self._put, self._get, self._delete = (self.redis.register_script(s) for s in (_PUT, _GET, _DELETE))
        self.breaker = Breaker(self.redis, log, "responses are not stored", "responses are stored")

    @property
    def available(self) -> bool:
        return not self.breaker.open

    @staticmethod
    def keys(tenant: str, response_id: str) -> list[str]:
        tag = "{" + quote(tenant, safe="") + "}"  # braces escaped: one tag per tenant, never shared
        return [f"responses:{tag}:r:{response_id}", f"responses:{tag}:lru", f"responses:{tag}:sizes",
                f"responses:{tag}:bytes"]

    def _call(self, script, keys, args):
        if self.breaker.open:
            raise StoreUnavailable("the response store (Redis) is unavailable")
        try:
            return script(keys=keys, args=args)
        except redis.RedisError as e:
            if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
                self.breaker.trip(e)
            else:
                log.error("response store script failed in Redis: %s", e)
            raise StoreUnavailable("the response store (Redis) is unavailable") from None

    def put(self, tenant: str, response_id: str, doc: dict) -> None:
        lim = self.limits
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
        self._call(self._put, self.keys(tenant, response_id),
                   [response_id, text, int(time.time() * 1000), int(lim.ttl_s * 1000), lim.max_entries, lim.max_bytes])

    def get(self, tenant: str, response_id: str) -> dict:
        doc = self._call(self._get, self.keys(tenant, response_id),
                         [response_id, int(time.time() * 1000), int(self.limits.ttl_s * 1000)])
        if doc is None:
            raise _missing(response_id)
        return json.loads(doc)

    def delete(self, tenant: str, response_id: str) -> None:
        if not self._call(self._delete, self.keys(tenant, response_id), [response_id]):
            raise _missing(response_id)

    def usage(self, tenant: str) -> tuple[int, int]:
        _, lru, _, total = self.keys(tenant, "")
        try:
            return self.redis.zcard(lru), int(self.redis.get(total) or 0)
        except redis.RedisError:
            raise StoreUnavailable("the response store (Redis) is unavailable") from None
