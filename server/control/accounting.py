"""What a request costs its project: the prices (:class:`Prices`), the worst case reserved at
admission and settled to what was used at the end (:class:`Reservation`), and the usage record
every generating route leaves (:class:`Accounting`).

A request reserves ``prompt tokens × input price + max_tokens × n × output price`` (and as many
tokens, for the token quota) before it is submitted, in one atomic step of the store
(``server/control/store.py``): concurrent requests on any replica see each other's
reservations, so together they never pass the limit. It settles to its ``usage`` when it ends,
so a running request is never cut, and its reservation is given back if it was never submitted.
"""
from __future__ import annotations

import calendar
import json
import math
import secrets
import time
from dataclasses import dataclass

from engine.config import ConfigError
from engine.errors import RateLimited
from server.control.state import ControlPlane
from server.control.store import ControlUnavailable, Settlement, UsageRecord, month_of
from server.tenancy.tenants import Tenant

NANO_PER_CENT = 10_000_000
#: A key's ``last_used_at`` is written at most this often by each process (seconds).
TOUCH_EVERY_S = 60.0
#: A running request renews its reservation this often (seconds; it lapses after
#: ``store.RESERVATION_TTL_S`` without one, when its process died).
RENEW_EVERY_S = 60.0


def month_end(t: float) -> float:
    """Unix time of the next UTC month's start after ``t``."""
    y, m = time.gmtime(t)[:2]
    return calendar.timegm((y + m // 12, m % 12 + 1, 1, 0, 0, 0))


class QuotaExceeded(RateLimited):
    """The project's spend limit or monthly token quota would be passed (HTTP 429,
    ``insufficient_quota``, as OpenAI answers an exhausted quota)."""

    code = "insufficient_quota"

    def __init__(self, message: str, now: float):
        super().__init__(message, month_end(now) - now, kind="quota")


@dataclass(frozen=True)
class Price:
    """Nano-dollars a token: input, cached input and output."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0


class Prices:
    """Operator-set prices (``--prices``: a JSON file ``{"<model id>": {"input": 0.15,
    "cached_input": 0.075, "output": 0.6}}``, US dollars per million tokens; 0 by default)."""

    def __init__(self, by_model: dict[str, Price]):
        self.by_model = by_model

    @property
    def any_set(self) -> bool:
        return any(p != Price() for p in self.by_model.values())

    def of(self, names: tuple[str, ...]) -> Price:
        """The price of the model served under ``names`` (the first of them the file names)."""
        return next((self.by_model[n] for n in names if n in self.by_model), Price())

    def check(self, names: tuple[str, ...], path: str) -> None:
        """Raises ConfigError if the file prices a model this server does not serve."""
        for model in self.by_model:
            if model not in names:
                raise ConfigError(f"prices file {path}: model {model!r} is not served here (its names: "
                                  f"{', '.join(names)})")

    @classmethod
    def load(cls, path: str) -> "Prices":
        """Raises ConfigError naming the model and field at fault."""
        if not path:
            return cls({})
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except OSError as e:
            raise ConfigError(f"prices file {path}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"prices file {path}: not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"prices file {path}: expected an object of models")
        out = {}
        for model, entry in data.items():
            if not isinstance(entry, dict) or not set(entry) <= {"input", "cached_input", "output"}:
                raise ConfigError(f"prices file {path}: model {model!r}: expected input, cached_input and output "
                                  "(US dollars per million tokens)")
            values = {}
            for name, value in entry.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e6:
                    raise ConfigError(f"prices file {path}: model {model!r}: {name} must be a number in [0, 1000000]")
                values[name] = value * 1000.0  # dollars per million tokens -> nano-dollars a token
            values.setdefault("cached_input", values.get("input", 0.0))
            out[model] = Price(**values)
        return cls(out)


class Reservation:
    """One request's reservation: made by :meth:`Accounting.reserve`, renewed while the request
    runs (:meth:`renew`), ended once by :meth:`settle` (what was used) or :meth:`release`
    (nothing was)."""

    def __init__(self, accounting: "Accounting", tenant: Tenant, month: str, rid: str | None):
        self.accounting, self.tenant, self.month, self.rid = accounting, tenant, month, rid
        self.done = False
        self._renewed = time.monotonic()

    def renew(self) -> None:
        """Called as the request runs: keeps the reservation held (every :data:`RENEW_EVERY_S`)."""
        if self.rid is None or self.done or time.monotonic() - self._renewed < RENEW_EVERY_S:
            return
        self._renewed = time.monotonic()
        try:
            self.accounting.control.store.renew(self.tenant.id, self.rid)
        except ControlUnavailable:  # tried again at the next renewal
            pass

    def settle(self, input_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        self.accounting.settle(self, input_tokens, output_tokens, cached_tokens)

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        if self.rid is not None:
            self.accounting.control.store.settle(self.tenant.id, self.month, self.rid, 0, 0)


class Accounting:
    """Spend and usage for the served model (``model_names``: every name it is served under)
    over the control plane ``control``; its usage counts under OpenAI's usage API ``api``
    (``completions`` or ``embeddings``: ``server/control/store.py``, ``UsageRecord``)."""

    def __init__(self, control: ControlPlane, prices: Prices, model_names: tuple[str, ...], clock=time.time,
                 api: str = "completions"):
        #: usage is recorded under the model's first name; its price is under any of them
        self.control, self.prices, self.model, self.clock, self.api = control, prices, model_names[0], clock, api
        self.price = prices.of(model_names)
        self.writes = control.writes
        self._touched: dict[str, float] = {}  # key id -> when this process last wrote its last use

    def _limits(self, tenant: Tenant) -> tuple[int | None, int | None]:
        """The project's cost limit (nano-dollars; only with a price set) and token quota."""
        state = self.control.state
        spend = state.doc("spend_limit", tenant.id)
        cost_limit = spend["threshold_amount"] * NANO_PER_CENT if spend and self.price != Price() else None
        project = state.projects.get(tenant.id) or {}
        return cost_limit, project.get("monthly_token_quota")

    def reserve(self, tenant: Tenant, prompt_tokens: int, max_output_tokens: int) -> Reservation:
        """Reserve the worst case, or refuse.

        Raises:
            QuotaExceeded: it would pass the spend limit or the token quota.
            ControlUnavailable: the store cannot be reached (503): a limit is not guessed.
        """
        month = month_of(self.clock())
        cost_limit, token_limit = self._limits(tenant)
        if cost_limit is None and token_limit is None:
            return Reservation(self, tenant, month, None)
        price = self.price
        cost = math.ceil(prompt_tokens * price.input + max_output_tokens * price.output)
        tokens = prompt_tokens + max_output_tokens
        rid = secrets.token_hex(12)
        ok, spend = self.control.store.reserve(tenant.id, month, rid, cost, tokens, cost_limit, token_limit)
        if not ok:
            if cost_limit is not None and spend.spent + spend.reserved + cost > cost_limit:
                raise QuotaExceeded(f"project {tenant.id!r} would pass its spend limit of "
                                    f"{cost_limit // NANO_PER_CENT} cents this month "
                                    f"(this request may cost up to {cost / NANO_PER_CENT:.4f} cents)", self.clock())
            raise QuotaExceeded(f"project {tenant.id!r} would pass its quota of {token_limit} tokens this month "
                                f"(this request may use up to {tokens})", self.clock())
        return Reservation(self, tenant, month, rid)

    def settle(self, reservation: Reservation, input_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        """Settle the spend to what was used and record the usage (one model request)."""
        tenant, price = reservation.tenant, self.price
        cost = math.ceil((input_tokens - cached_tokens) * price.input + cached_tokens * price.cached_input
                         + output_tokens * price.output)
        now = self.clock()
        # every request's spend and tokens, so a limit set later counts the whole month
        self.writes.add(Settlement(tenant.id, reservation.month, reservation.rid or secrets.token_hex(12), cost,
                                   input_tokens + output_tokens),
                        UsageRecord(tenant.id, tenant.key_id or "", self.model, now, input_tokens,
                                    output_tokens, cached_tokens, api=self.api))
        if tenant.key_id and now - self._touched.get(tenant.key_id, 0.0) >= TOUCH_EVERY_S:
            if len(self._touched) > 100_000:  # keys seen by this process: bounded
                self._touched.clear()
            self._touched[tenant.key_id] = now
            try:
                self.control.store.touch(tenant.key_id, now)
            except ControlUnavailable:
                pass
