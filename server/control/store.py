"""The control plane's state: documents (projects, service accounts, API keys, rate limits, spend
limits), the month's spend with its reservations, and usage buckets. Two backends with one
interface and the same rules:

- :class:`RedisControl` (``--redis-url``): shared by every replica.
  ``control:docs`` (a hash, ``<kind>/<id>`` -> JSON) and ``control:version`` (a counter bumped by
  every change, which each process polls to refresh its copy: ``server/control/registry.py``);
  spend under the project's hash tag, ``spend:{<project>}:<YYYY-MM>`` (``spent``, ``reserved``,
  ``tokens``, ``tokens_reserved``) with its reservations (``spend:{<project>}:resv``, a sorted
  set by expiry, and ``...:resv:amt``), changed only by the Lua scripts below, so a check and its
  reservation are one atomic step whichever replica runs it; usage in one hash per API and
  bucket, ``usage:<width>:<start>`` (completions) and ``usage:embeddings:<width>:<start>``,
  fields ``<project>\\x1f<key>\\x1f<model>\\x1f<counter>``, each
  with a TTL of its width's retention (:data:`RETENTION_S`); each key's last use (unix seconds,
  written at most once a minute per key and process) in ``control:last_used``.
- :class:`SqliteControl` (no Redis): the node's SQLite file (``--control-db``), the same tables
  (usage in ``usage`` and ``usage_embeddings``), each change one ``BEGIN IMMEDIATE`` transaction.

Money is counted in nano-dollars (integers; a price of $0.15 per million tokens is 150
nano-dollars a token), so that sums are exact.

Unlike the rate limiter, the control plane does not fail open: a reservation that cannot reach
Redis is refused (503, the request may be retried), because a spend limit that lets requests
through while Redis is down would not hold. What a finished request writes, if it cannot, is
kept in memory and written with a later request's (:class:`WriteBehind`), bounded. As the rate
limiter's, Redis calls never wait on an outage: a circuit breaker opens at the first connection
failure (``server/tenancy/redis_link.py``).
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

from engine.errors import EngineUnavailable
from server.tenancy.redis_link import Breaker, fast_redis

log = logging.getLogger("control")

#: Usage bucket widths (OpenAI's ``bucket_width``) in seconds, and how long each is kept.
WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
RETENTION_S = {"1m": 30 * 86400, "1h": 90 * 86400, "1d": 400 * 86400}
#: A reservation not renewed for this long (its process died) is given back; a running request
#: renews its own every ``accounting.RENEW_EVERY_S``.
RESERVATION_TTL_S = 600
_COUNTERS = ("input_tokens", "output_tokens", "input_cached_tokens", "num_model_requests")
_SEP = "\x1f"


class ControlUnavailable(EngineUnavailable):
    """The control plane's state could not be reached (HTTP 503 with ``Retry-After``)."""

    def __init__(self, message: str = "the control plane's state is unavailable; retry shortly"):
        super().__init__(message)
        self.retry_after = 1


@dataclass(frozen=True)
class Spend:
    """A project's month: ``spent`` and ``reserved`` nano-dollars, ``tokens`` and
    ``tokens_reserved`` (every input and output token, for the token quota)."""

    spent: int = 0
    reserved: int = 0
    tokens: int = 0
    tokens_reserved: int = 0


@dataclass(frozen=True)
class UsageRecord:
    """One request's usage: who (project, key id, model), when (unix seconds), its counts, and
    the usage API it counts under (OpenAI's ``/organization/usage/<api>``: ``completions`` for a
    generation model's request, ``embeddings`` for an embedding model's; :data:`_TABLES`)."""

    project_id: str
    api_key_id: str
    model: str
    at: float
    input_tokens: int
    output_tokens: int
    input_cached_tokens: int
    num_model_requests: int = 1
    api: str = "completions"

    def counts(self) -> tuple[int, int, int, int]:
        return self.input_tokens, self.output_tokens, self.input_cached_tokens, self.num_model_requests


@dataclass(frozen=True)
class Settlement:
    """A request's end as the store records it: reservation ``rid`` of ``project`` in ``month``
    given back (if still held), ``cost`` nano-dollars and ``tokens`` added."""

    project: str
    month: str
    rid: str
    cost: int
    tokens: int


def month_of(t: float) -> str:
    """``YYYY-MM`` of unix time ``t``, in UTC."""
    return time.strftime("%Y-%m", time.gmtime(t))


def bucket_start(t: float, width: str) -> int:
    """The start (unix seconds, UTC) of the ``width`` bucket holding ``t``."""
    w = WIDTHS[width]
    return int(t // w * w)


def _bucket_key(api: str, width: str, start: int) -> str:
    """Redis's hash of API ``api``'s ``width`` bucket starting at ``start`` (completions' keep
    the name they had before embeddings had buckets of their own)."""
    return f"usage:{width}:{start}" if api == "completions" else f"usage:{api}:{width}:{start}"


_RESERVE = """
-- KEYS: month hash, reservations zset, reservation amounts. ARGV: id, cost, tokens, cost limit,
-- token limit (-1: none), ttl ms, month. Expired reservations are given back first.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  local amt = redis.call('HGET', KEYS[3], id)
  if amt then
    local c, k, m = string.match(amt, '(%d+),(%d+),(.+)')
    if m == ARGV[7] then
      redis.call('HINCRBY', KEYS[1], 'reserved', 0 - tonumber(c))
      redis.call('HINCRBY', KEYS[1], 'tokens_reserved', 0 - tonumber(k))
    end
  end
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
local v = redis.call('HMGET', KEYS[1], 'spent', 'reserved', 'tokens', 'tokens_reserved')
local spent, reserved = tonumber(v[1] or 0), tonumber(v[2] or 0)
local tokens, tokens_reserved = tonumber(v[3] or 0), tonumber(v[4] or 0)
local cost, ntok = tonumber(ARGV[2]), tonumber(ARGV[3])
local climit, tlimit = tonumber(ARGV[4]), tonumber(ARGV[5])
if (climit >= 0 and spent + reserved + cost > climit) or (tlimit >= 0 and tokens + tokens_reserved + ntok > tlimit) then
  return {0, spent, reserved, tokens, tokens_reserved}
end
redis.call('HINCRBY', KEYS[1], 'reserved', cost)
redis.call('HINCRBY', KEYS[1], 'tokens_reserved', ntok)
redis.call('PEXPIRE', KEYS[1], 400 * 86400000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2] .. ',' .. ARGV[3] .. ',' .. ARGV[7])
return {1, spent, reserved + cost, tokens, tokens_reserved + ntok}
"""

_RENEW = """
-- KEYS: reservations zset. ARGV: id, ttl ms. Only a reservation still held.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

#: Lua: reservation ARGV[1] given back (if still held: KEYS[1] month hash, KEYS[2] reservations
#: zset, KEYS[3] reservation amounts) and ARGV[2] nano-dollars and ARGV[3] tokens added.
_GIVE_BACK_AND_ADD = """
local amt = redis.call('HGET', KEYS[3], ARGV[1])
if amt then
  local c, k = string.match(amt, '(%d+),(%d+),')
  redis.call('HINCRBY', KEYS[1], 'reserved', 0 - tonumber(c))
  redis.call('HINCRBY', KEYS[1], 'tokens_reserved', 0 - tonumber(k))
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
end
redis.call('HINCRBY', KEYS[1], 'spent', tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[1], 'tokens', tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], 400 * 86400000)
"""

_SETTLE = """
-- KEYS: month hash, reservations zset, reservation amounts. ARGV: id, cost, tokens.
""" + _GIVE_BACK_AND_ADD + "return 1\n"


#: Socket timeout of the documents' reads and writes (seconds): the whole state is read at once
#: (10,000 projects are megabytes), off the request path but for an unknown key's catch-up.
DOCUMENTS_TIMEOUT_S = 2.0


_FINISH = """
-- A request's end, once whatever the retries: its reservation given back and its spend and usage
-- added. KEYS: month hash, reservations zset, reservation amounts, finished ids (zset by time),
-- the 1m, 1h and 1d usage buckets. ARGV: id, cost, tokens, usage field prefix, input, output,
-- cached, requests, then each bucket's TTL (s).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - 3600000)
if redis.call('ZADD', KEYS[4], 'NX', now, ARGV[1]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[4], 3600000)
""" + _GIVE_BACK_AND_ADD + """
local names = {'input_tokens', 'output_tokens', 'input_cached_tokens', 'num_model_requests'}
for i = 5, 7 do
  for j = 1, 4 do
    local n = tonumber(ARGV[4 + j])
    if n > 0 then redis.call('HINCRBY', KEYS[i], ARGV[4] .. names[j], n) end
  end
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[4 + i]))
end
return 1
"""


class RedisControl:
    """The state in Redis (see the module docstring). Every call raises
    :class:`ControlUnavailable` when Redis cannot be reached: a request's own calls (spend,
    usage) within the rate limiter's 50 ms (``fast_redis``), the documents' within
    :data:`DOCUMENTS_TIMEOUT_S`."""

    def __init__(self, url: str):
        self.redis = fast_redis(url)
        self.docs_redis = redis.Redis.from_url(url, socket_timeout=DOCUMENTS_TIMEOUT_S,
                                               socket_connect_timeout=DOCUMENTS_TIMEOUT_S)
        self._reserve = self.redis.register_script(_RESERVE)
        self._settle = self.redis.register_script(_SETTLE)
        self._renew = self.redis.register_script(_RENEW)
        self._finish = self.redis.register_script(_FINISH)
        # as the rate limiter's: the first connection failure opens it (one log line), and until
        # a probe gets an answer no call waits on Redis
        self.breaker = Breaker(self.redis, log, "the control plane keeps its last state, and spend and usage wait "
                               "in memory", "the control plane's state is shared again")

    def _call(self, fn, *args, **kwargs):
        if self.breaker.open:
            raise ControlUnavailable()
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self.breaker.trip(e)
            raise ControlUnavailable() from None
        except redis.RedisError as e:  # Redis answered, with an error: not an outage
            log.error("control plane: Redis refused a call (%s)", e)
            raise ControlUnavailable() from None

    # documents
    def version(self) -> int:
        return int(self._call(self.redis.get, "control:version") or 0)

    def documents(self) -> tuple[int, dict[str, dict]]:
        """``(version, {"<kind>/<id>": document})``, read together."""
        pipe = self.docs_redis.pipeline(transaction=True)
        pipe.get("control:version")
        pipe.hgetall("control:docs")
        version, docs = self._call(pipe.execute)
        return int(version or 0), {k.decode(): json.loads(v) for k, v in docs.items()}

    def write(self, puts: dict[str, dict], deletes: tuple[str, ...] = ()) -> None:
        """Put and delete documents, and bump the version, in one transaction."""
        pipe = self.docs_redis.pipeline(transaction=True)
        if puts:
            pipe.hset("control:docs", mapping={k: json.dumps(v) for k, v in puts.items()})
        if deletes:
            pipe.hdel("control:docs", *deletes)
        pipe.incr("control:version")
        self._call(pipe.execute)

    # spend
    @staticmethod
    def _spend_keys(project: str, month: str) -> list[str]:
        tag = "spend:{" + quote(project, safe="") + "}"
        return [f"{tag}:{month}", f"{tag}:resv", f"{tag}:resv:amt", f"{tag}:done"]

    def reserve(self, project: str, month: str, rid: str, cost: int, tokens: int,
                cost_limit: int | None, token_limit: int | None) -> tuple[bool, Spend]:
        """Reserve ``cost`` nano-dollars and ``tokens`` if the month's spent + reserved + them stay
        within the limits (None: no limit), atomically. Returns ``(reserved, the month after)``."""
        out = self._call(self._reserve, keys=self._spend_keys(project, month)[:3],
                         args=[rid, cost, tokens, -1 if cost_limit is None else cost_limit,
                               -1 if token_limit is None else token_limit, RESERVATION_TTL_S * 1000, month])
        return bool(out[0]), Spend(*(int(x) for x in out[1:]))

    def renew(self, project: str, rid: str) -> None:
        """Keep reservation ``rid`` another :data:`RESERVATION_TTL_S` (its request still runs)."""
        self._call(self._renew, keys=self._spend_keys(project, "")[1:2], args=[rid, RESERVATION_TTL_S * 1000])

    def settle(self, project: str, month: str, rid: str, cost: int, tokens: int) -> None:
        """Give back reservation ``rid`` (if still held) and add what was used."""
        self._call(self._settle, keys=self._spend_keys(project, month)[:3], args=[rid, cost, tokens])

    def spend(self, project: str, month: str) -> Spend:
        v = self._call(self.redis.hmget, self._spend_keys(project, month)[0],
                       "spent", "reserved", "tokens", "tokens_reserved")
        return Spend(*(int(x or 0) for x in v))

    def spends(self, projects: list[str], month: str) -> dict[str, Spend]:
        """The month of every project of ``projects``, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for project in projects:
            pipe.hmget(self._spend_keys(project, month)[0], "spent", "reserved", "tokens", "tokens_reserved")
        return {p: Spend(*(int(x or 0) for x in v)) for p, v in zip(projects, self._call(pipe.execute))}

    # keys' last use
    def touch(self, key_id: str, at: float) -> None:
        """Note that key ``key_id`` was used at unix time ``at``."""
        self._call(self.redis.hset, "control:last_used", key_id, int(at))

    def last_used(self, key_ids: list[str]) -> dict[str, int | None]:
        values = self._call(self.redis.hmget, "control:last_used", key_ids) if key_ids else []
        return {k: int(v) if v else None for k, v in zip(key_ids, values)}

    def forget(self, key_ids: list[str]) -> None:
        """Drop revoked keys' last use."""
        if key_ids:
            self._call(self.redis.hdel, "control:last_used", *key_ids)

    # a request's end
    def finish(self, s: Settlement, r: UsageRecord) -> None:
        """Settle ``s`` and add ``r`` to its 1m, 1h and 1d buckets, atomically and once per
        ``s.rid`` (a retry of a call that timed out after Redis applied it changes nothing: the
        ids finished in the last hour are kept)."""
        group = _SEP.join((r.project_id, r.api_key_id, r.model)) + _SEP
        buckets = [_bucket_key(r.api, width, bucket_start(r.at, width)) for width in WIDTHS]
        ttls = [RETENTION_S[width] + WIDTHS[width] for width in WIDTHS]
        self._call(self._finish, keys=self._spend_keys(s.project, s.month) + buckets,
                   args=[s.rid, s.cost, s.tokens, group, *r.counts(), *ttls])

    def usage(self, width: str, starts: list[int], api: str = "completions"
              ) -> dict[int, dict[tuple[str, str, str], list[int]]]:
        """``{start: {(project, key, model): [input, output, cached, requests]}}`` of API
        ``api``'s buckets starting at ``starts``."""
        pipe = self.redis.pipeline(transaction=False)
        for s in starts:
            pipe.hgetall(_bucket_key(api, width, s))
        out = {}
        for s, fields in zip(starts, self._call(pipe.execute)):
            rows = out.setdefault(s, {})
            for f, n in fields.items():
                project, key, model, name = f.decode().split(_SEP)
                rows.setdefault((project, key, model), [0, 0, 0, 0])[_COUNTERS.index(name)] += int(n)
        return out


#: The usage APIs, each with its SQLite table (Redis: :func:`_bucket_key`).
_TABLES = {"completions": "usage", "embeddings": "usage_embeddings"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS spend (project TEXT, month TEXT, spent INTEGER DEFAULT 0, reserved INTEGER DEFAULT 0,
  tokens INTEGER DEFAULT 0, tokens_reserved INTEGER DEFAULT 0, PRIMARY KEY (project, month));
CREATE TABLE IF NOT EXISTS reservations (id TEXT PRIMARY KEY, project TEXT, month TEXT, cost INTEGER,
  tokens INTEGER, expires REAL);
CREATE INDEX IF NOT EXISTS reservations_expiry ON reservations (project, expires);
CREATE TABLE IF NOT EXISTS last_used (key TEXT PRIMARY KEY, at INTEGER);
CREATE TABLE IF NOT EXISTS finished (id TEXT PRIMARY KEY, at REAL);
CREATE TABLE IF NOT EXISTS usage (width TEXT, start INTEGER, project TEXT, api_key TEXT, model TEXT,
  input_tokens INTEGER, output_tokens INTEGER, input_cached_tokens INTEGER, num_model_requests INTEGER,
  PRIMARY KEY (width, start, project, api_key, model));
CREATE TABLE IF NOT EXISTS usage_embeddings (width TEXT, start INTEGER, project TEXT, api_key TEXT, model TEXT,
  input_tokens INTEGER, output_tokens INTEGER, input_cached_tokens INTEGER, num_model_requests INTEGER,
  PRIMARY KEY (width, start, project, api_key, model));
"""


class SqliteControl:
    """The state in the node's SQLite file ``path`` (``:memory:``: this process only; tests'
    in-process app). One connection per process, shared by its threads under a lock."""

    def __init__(self, path: str):
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
        self.lock = threading.Lock()
        with self.lock:
            if path != ":memory:":
                self.db.execute("PRAGMA journal_mode=WAL")
                # a commit is durable against a crash of the process (not of the machine) without an fsync
                self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
        self._pruned = 0.0

    def _tx(self, fn):
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self.db)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return out

    def version(self) -> int:
        with self.lock:
            row = self.db.execute("SELECT v FROM meta WHERE k = 'version'").fetchone()
        return row[0] if row else 0

    def documents(self) -> tuple[int, dict[str, dict]]:
        def read(db):
            row = db.execute("SELECT v FROM meta WHERE k = 'version'").fetchone()
            return (row[0] if row else 0), {n: json.loads(d) for n, d in db.execute("SELECT name, doc FROM docs")}
        return self._tx(read)

    def write(self, puts: dict[str, dict], deletes: tuple[str, ...] = ()) -> None:
        def change(db):
            db.executemany("INSERT OR REPLACE INTO docs VALUES (?, ?)", [(k, json.dumps(v)) for k, v in puts.items()])
            db.executemany("DELETE FROM docs WHERE name = ?", [(k,) for k in deletes])
            db.execute("INSERT INTO meta VALUES ('version', 1) ON CONFLICT (k) DO UPDATE SET v = v + 1")
        self._tx(change)

    def reserve(self, project: str, month: str, rid: str, cost: int, tokens: int,
                cost_limit: int | None, token_limit: int | None) -> tuple[bool, Spend]:
        def run(db):
            now = time.time()
            for c, k in db.execute("SELECT cost, tokens FROM reservations WHERE project = ? AND month = ? "
                                   "AND expires <= ?", (project, month, now)).fetchall():
                db.execute("UPDATE spend SET reserved = reserved - ?, tokens_reserved = tokens_reserved - ? "
                           "WHERE project = ? AND month = ?", (c, k, project, month))
            db.execute("DELETE FROM reservations WHERE project = ? AND expires <= ?", (project, now))
            db.execute("INSERT OR IGNORE INTO spend (project, month) VALUES (?, ?)", (project, month))
            spend = Spend(*db.execute("SELECT spent, reserved, tokens, tokens_reserved FROM spend "
                                      "WHERE project = ? AND month = ?", (project, month)).fetchone())
            if (cost_limit is not None and spend.spent + spend.reserved + cost > cost_limit) or \
                    (token_limit is not None and spend.tokens + spend.tokens_reserved + tokens > token_limit):
                return False, spend
            db.execute("UPDATE spend SET reserved = reserved + ?, tokens_reserved = tokens_reserved + ? "
                       "WHERE project = ? AND month = ?", (cost, tokens, project, month))
            db.execute("INSERT INTO reservations VALUES (?, ?, ?, ?, ?, ?)",
                       (rid, project, month, cost, tokens, now + RESERVATION_TTL_S))
            return True, Spend(spend.spent, spend.reserved + cost, spend.tokens, spend.tokens_reserved + tokens)
        return self._tx(run)

    def renew(self, project: str, rid: str) -> None:
        self._tx(lambda db: db.execute("UPDATE reservations SET expires = ? WHERE id = ?",
                                       (time.time() + RESERVATION_TTL_S, rid)))

    def settle(self, project: str, month: str, rid: str, cost: int, tokens: int) -> None:
        self._tx(lambda db: self._settle(db, project, month, rid, cost, tokens))

    @staticmethod
    def _settle(db, project: str, month: str, rid: str, cost: int, tokens: int) -> None:
        db.execute("INSERT OR IGNORE INTO spend (project, month) VALUES (?, ?)", (project, month))
        row = db.execute("SELECT cost, tokens FROM reservations WHERE id = ?", (rid,)).fetchone()
        if row:
            db.execute("UPDATE spend SET reserved = reserved - ?, tokens_reserved = tokens_reserved - ? "
                       "WHERE project = ? AND month = ?", (*row, project, month))
            db.execute("DELETE FROM reservations WHERE id = ?", (rid,))
        db.execute("UPDATE spend SET spent = spent + ?, tokens = tokens + ? WHERE project = ? AND month = ?",
                   (cost, tokens, project, month))

    def spend(self, project: str, month: str) -> Spend:
        with self.lock:
            row = self.db.execute("SELECT spent, reserved, tokens, tokens_reserved FROM spend "
                                  "WHERE project = ? AND month = ?", (project, month)).fetchone()
        return Spend(*row) if row else Spend()

    def spends(self, projects: list[str], month: str) -> dict[str, Spend]:
        with self.lock:
            rows = self.db.execute("SELECT project, spent, reserved, tokens, tokens_reserved FROM spend "
                                   "WHERE month = ?", (month,)).fetchall()
        found = {r[0]: Spend(*r[1:]) for r in rows}
        return {p: found.get(p, Spend()) for p in projects}

    def touch(self, key_id: str, at: float) -> None:
        self._tx(lambda db: db.execute("INSERT OR REPLACE INTO last_used VALUES (?, ?)", (key_id, int(at))))

    def last_used(self, key_ids: list[str]) -> dict[str, int | None]:
        with self.lock:
            found = dict(self.db.execute(f"SELECT key, at FROM last_used WHERE key IN ({','.join('?' * len(key_ids))})",
                                         key_ids).fetchall()) if key_ids else {}
        return {k: found.get(k) for k in key_ids}

    def forget(self, key_ids: list[str]) -> None:
        self._tx(lambda db: db.executemany("DELETE FROM last_used WHERE key = ?", [(k,) for k in key_ids]))

    def finish(self, s: Settlement, r: UsageRecord) -> None:
        def run(db):
            now = time.time()
            if db.execute("INSERT OR IGNORE INTO finished VALUES (?, ?)", (s.rid, now)).rowcount == 0:
                return  # done already
            self._settle(db, s.project, s.month, s.rid, s.cost, s.tokens)
            for width in WIDTHS:
                db.execute(f"INSERT INTO {_TABLES[r.api]} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                           "ON CONFLICT DO UPDATE SET "
                           "input_tokens = input_tokens + excluded.input_tokens, "
                           "output_tokens = output_tokens + excluded.output_tokens, "
                           "input_cached_tokens = input_cached_tokens + excluded.input_cached_tokens, "
                           "num_model_requests = num_model_requests + excluded.num_model_requests",
                           (width, bucket_start(r.at, width), r.project_id, r.api_key_id, r.model, *r.counts()))
            if now - self._pruned > 60:  # retention: at most once a minute per process
                self._pruned = now
                for width, keep in RETENTION_S.items():
                    for table in _TABLES.values():
                        db.execute(f"DELETE FROM {table} WHERE width = ? AND start < ?", (width, now - keep))
                db.execute("DELETE FROM finished WHERE at < ?", (now - 3600,))
        self._tx(run)

    def usage(self, width: str, starts: list[int], api: str = "completions"
              ) -> dict[int, dict[tuple[str, str, str], list[int]]]:
        out = {s: {} for s in starts}
        if not starts:
            return out
        with self.lock:
            rows = self.db.execute("SELECT start, project, api_key, model, input_tokens, output_tokens, "
                                   f"input_cached_tokens, num_model_requests FROM {_TABLES[api]} WHERE width = ? "
                                   "AND start >= ? AND start <= ?", (width, min(starts), max(starts))).fetchall()
        for start, project, key, model, *counts in rows:
            if start in out:
                out[start][(project, key, model)] = list(counts)
        return out


class WriteBehind:
    """What a finished request writes (its :class:`Settlement` and :class:`UsageRecord`, one
    ``finish`` of the store): at once, or, while the store is unreachable, kept in memory (at
    most ``limit`` requests; beyond, the oldest are dropped, said once) and written before the
    next request's, or by :meth:`flush` (the control plane's poll, every ``POLL_S``, so that what
    waited is written once the store answers, whatever the traffic). One per process, shared by
    every model's accounting. An answer is never held up or failed by it; ``finish`` is once per
    request id, so a retry never counts twice."""

    def __init__(self, store, limit: int = 10_000):
        self.store, self.limit = store, limit
        self.pending: list[tuple[Settlement, UsageRecord]] = []
        self.lock = threading.Lock()
        self._dropping = False

    def add(self, settlement: Settlement, record: UsageRecord) -> None:
        with self.lock:
            self.pending.append((settlement, record))
            if len(self.pending) > self.limit:
                del self.pending[0]
                if not self._dropping:
                    log.warning("control plane: %d requests' spend and usage wait for the store; the oldest are "
                                "dropped from now on", self.limit)
                self._dropping = True
            self._write()

    def flush(self) -> None:
        """Write what waits, if anything does and the store answers."""
        if self.pending:
            with self.lock:
                self._write()

    def _write(self) -> None:
        try:
            while self.pending:
                self.store.finish(*self.pending[0])
                del self.pending[0]
            self._dropping = False
        except ControlUnavailable:
            pass


def open_store(redis_url: str, path: str):
    """The state for this configuration: Redis if ``redis_url``, else the SQLite file ``path``."""
    return RedisControl(redis_url) if redis_url else SqliteControl(path)
