"""Per-tenant token buckets, shared across replicas through Redis, failing open to buckets shared
by the processes of this node.

Up to three buckets per tenant, each optional: requests per second (each request costs 1),
tokens per second (the prompt at admission, generated tokens while they are produced), and
requests per day (OpenAI's ``max_requests_per_1_day``: a bucket of that burst refilled over a
day; each request costs 1). A request is admitted only when every bucket it has holds at least
1; admission takes from each atomically.
Generated tokens are charged without a check, so a running request is never cut and a tenant
that overran waits until its bucket refills above 1.

Redis: one Lua script refills, checks and takes atomically, with the time from Redis ``TIME``
(not each replica's clock), keys hash-tagged per tenant (``ratelimit:{<tenant>}:requests``,
``:tokens``, ``:requests_per_day``) so they share one Redis Cluster slot, and a TTL so idle tenants leave nothing behind.

Fail-open (``server/tenancy/redis_link.py``): socket and connect timeouts of 50 ms and no
retries; the first failure opens a circuit breaker, which logs once, serves from the node's
shared buckets (``shm.buckets``, same parameters), and probes Redis in the background until it
answers.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote

import redis

from engine.errors import RateLimited
from server.tenancy.redis_link import Breaker, fast_redis
from server.tenancy.tenants import Rate, Tenant, tenant_index

log = logging.getLogger("ratelimit")
_INT63 = (1 << 63) - 1

_SCRIPT = """
-- KEYS: one bucket each. ARGV: per bucket rate, burst, cost, then check (1: admission,
-- all-or-nothing against level >= 1).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local check = ARGV[#ARGV] == '1'
local levels, allowed = {}, 1
for i = 1, #KEYS do
  local rate, burst = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1])
  local v = redis.call('HMGET', KEYS[i], 'level', 't')
  local level = burst
  if v[1] then level = math.min(burst, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * rate) end
  levels[i] = level
  if check and level < 1 then allowed = 0 end
end
local out = {allowed}
for i = 1, #KEYS do
  local rate, burst, cost = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  local level = levels[i]
  if allowed == 1 then level = math.min(burst, level - cost) end
  redis.call('HSET', KEYS[i], 'level', tostring(level), 't', tostring(now))
  -- Gone once full again (capped so Lua prints it as an integer).
  redis.call('PEXPIRE', KEYS[i], math.min(100000000000, math.ceil(((burst - level) / rate + 1) * 1000)))
  out[i + 1] = tostring(level)
end
return out
"""


@dataclass(frozen=True)
class Decision:
    """The outcome of one admission: ``allowed``, ``retry_after_s`` (0 when allowed) and, per
    limited bucket (``requests``, ``tokens``), ``(limit, remaining, reset seconds)`` for the
    ``x-ratelimit-*`` headers."""

    allowed: bool
    retry_after_s: float
    buckets: dict


def _decide(limits: dict[str, Rate], levels: dict[str, float], allowed: bool) -> Decision:
    """Retry-after and header values from the levels after the script ran."""
    retry = 0.0 if allowed else max((1 - levels[k]) / limits[k].rate for k in levels if levels[k] < 1)
    buckets = {k: (limits[k].burst, max(0, math.floor(levels[k])),
                   max(0.0, (limits[k].burst - levels[k]) / limits[k].rate)) for k in levels}
    return Decision(allowed, retry, buckets)


#: The buckets a tenant may have, each with its number in the node's local keys.
KINDS = ("requests", "tokens", "requests_per_day")


def _costs(prompt_tokens: int, sign: int) -> dict[str, int]:
    """What admitting a request takes from each bucket (``sign`` -1: what a refund gives back)."""
    return {"requests": sign, "tokens": sign * prompt_tokens, "requests_per_day": sign}


def _limits(tenant: Tenant) -> dict[str, Rate]:
    rates = (tenant.requests_per_second, tenant.tokens_per_second, tenant.requests_per_day)
    return {k: r for k, r in zip(KINDS, rates) if r}


class RateLimiter:
    """Admission and charging of every tenant's buckets.

    Args:
        local: the node's shared buckets (``EngineClient.buckets``); also the fallback.
        redis_url: ``redis://`` / ``rediss://`` (with a password if needed); empty: local only.
        clock: ``time.monotonic``-like seconds, for the local buckets.
    """

    def __init__(self, local, redis_url: str = "", clock: Callable[[], float] = time.monotonic):
        self.local, self.clock = local, clock
        self.redis = None
        self.breaker = None
        if redis_url:
            self.redis = fast_redis(redis_url)
            self._script = self.redis.register_script(_SCRIPT)
            self.breaker = Breaker(self.redis, log, "rate limits fall back to this node's buckets",
                                   "rate limits are shared across replicas")
        self._script_failed = False

    @property
    def using_redis(self) -> bool:
        return self.redis is not None and not self.breaker.open

    def admit(self, tenant: Tenant, prompt_tokens: int) -> Decision:
        """Take one request and ``prompt_tokens`` tokens, or nothing.

        Raises:
            RateLimited: a bucket is below 1 (``retry_after_s``, ``buckets`` for the headers).
        """
        limits = _limits(tenant)
        if not limits:
            return Decision(True, 0.0, {})
        decision = self._run(tenant, limits, _costs(prompt_tokens, 1), check=True)
        if not decision.allowed:
            raise RateLimited(f"tenant {tenant.id!r} is over its rate limit", decision.retry_after_s,
                              decision.buckets)
        return decision

    def refund(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Give back what :meth:`admit` took, for a request that was then not served (the
        server was full); levels never exceed the burst."""
        limits = _limits(tenant)
        if limits:
            self._run(tenant, limits, _costs(prompt_tokens, -1), check=False)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Take ``tokens`` generated tokens, unconditionally (the level may go below zero)."""
        if tokens > 0 and tenant.tokens_per_second is not None:
            self._run(tenant, {"tokens": tenant.tokens_per_second}, {"tokens": tokens}, check=False)

    def _run(self, tenant: Tenant, limits: dict[str, Rate], costs: dict[str, float], check: bool) -> Decision:
        if self.using_redis:
            try:
                return self._redis(tenant, limits, costs, check)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self.breaker.trip(e)
            except redis.RedisError as e:  # Redis answered, with an error: not an outage
                if not self._script_failed:
                    self._script_failed = True
                    log.error("rate-limit script failed in Redis (%s); this call used the local buckets", e)
        return self._local(tenant, limits, costs, check)

    def _redis(self, tenant: Tenant, limits, costs, check: bool) -> Decision:
        kinds = list(limits)
        args = [x for k in kinds for x in (limits[k].rate, limits[k].burst, costs.get(k, 0))]
        tag = "{" + quote(tenant.id, safe="") + "}"  # braces escaped: one tag per tenant, never shared
        scope = f"{quote(tenant.scope, safe='')}:" if tenant.scope else ""  # a project's buckets per model
        out = self._script(keys=[f"ratelimit:{tag}:{scope}{k}" for k in kinds], args=args + [int(check)])
        return _decide(limits, {k: float(v) for k, v in zip(kinds, out[1:])}, bool(int(out[0])))

    def _local(self, tenant: Tenant, limits, costs, check: bool) -> Decision:
        kinds = list(limits)
        index = tenant_index(f"{tenant.id}/{tenant.scope}") if tenant.scope else tenant.index
        keys = {k: ((index << 2) | i) & _INT63 or 1 for i, k in enumerate(KINDS)}
        allowed, levels = self.local.take([(keys[k], limits[k].rate, limits[k].burst, costs.get(k, 0)) for k in kinds],
                                          check, self.clock())
        return _decide(limits, dict(zip(kinds, levels)), allowed)
