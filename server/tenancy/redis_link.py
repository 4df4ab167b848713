"""The server's link to Redis: a client that never makes a request wait, and a circuit breaker.

Both users of Redis (the rate limiter, ``server/tenancy/ratelimit.py``, and the Responses
store, ``server/responses/store.py``) serve requests while Redis is down, so both need the same
two things: socket and connect timeouts of :data:`REDIS_TIMEOUT_S` with no retries (redis-py's
defaults would hold a request for seconds), and a breaker that opens at the first connection
failure, logs once, and probes Redis in the background every :data:`PROBE_S` until it answers.
"""
from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

#: Redis socket and connect timeout, seconds: a request never waits longer on Redis.
REDIS_TIMEOUT_S = 0.05
#: Seconds between probes of a Redis that failed.
PROBE_S = 0.5


def fast_redis(url: str) -> redis.Redis:
    """A client for ``url`` (``redis://`` / ``rediss://``, with a password if needed) with the
    timeouts above and no retries; ours win over options in the URL."""
    pool = redis.ConnectionPool.from_url(url)
    pool.connection_kwargs.update(socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
                                  retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
    return redis.Redis(connection_pool=pool)


class Breaker:
    """Open while Redis is considered down. Thread-safe.

    Args:
        client: the Redis client to probe.
        log: where the two state changes are logged (a warning each).
        down, up: what they mean for the user of Redis (``"responses are not stored"``...).
    """

    def __init__(self, client: redis.Redis, log: logging.Logger, down: str, up: str):
        self.client, self.log, self.down, self.up = client, log, down, up
        self.open = False
        self._lock = threading.Lock()

    def trip(self, error: Exception) -> None:
        """Open the breaker after ``error`` (a connection error or a timeout), once."""
        with self._lock:
            if self.open:
                return
            self.open = True
        self.log.warning("Redis unavailable (%s); %s until it answers", type(error).__name__, self.down)
        threading.Thread(target=self._probe, name="redis-probe", daemon=True).start()

    def _probe(self) -> None:
        while True:
            time.sleep(PROBE_S)
            try:
                self.client.ping()
            except redis.RedisError:
                continue
            self.open = False
            self.log.warning("Redis answers again; %s", self.up)
            return
