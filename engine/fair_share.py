"""Tenant fair share: the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024). Each tenant's counter grows by the tokens it is served divided by
its weight; the backlogged tenant with the smallest counter goes first; a tenant that becomes
backlogged is lifted to the smallest counter among the backlogged (to the counter of the tenant
served last when none is), so it cannot bank credit while idle, nor a newcomer start below a
tenant that was served alone meanwhile. Used by the generation scheduler
(``engine/scheduler.py``) and the embedding loop (``engine/embed_core.py``), each over its own
queue.
"""
from __future__ import annotations

from typing import Iterable


class TokenCounters(dict):
    """``{tenant id: virtual tokens served}`` (float; a tenant never served reads 0).

    Attributes:
        last: the counter of the tenant charged last, after that charge (0 before any).
    """

    last = 0.0

    def __missing__(self, tenant: int) -> float:
        return 0.0

    def lift(self, tenant: int, backlogged: Iterable[int]) -> None:
        """``tenant`` has a sequence to queue; ``backlogged``: the tenants of the sequences already
        queued or running. A tenant not among them starts at their smallest counter, or, when
        there are none, at :attr:`last` (a tenant served alone while the others were idle has
        earned no debt to a newcomer); never below its own."""
        backlogged = set(backlogged)
        if tenant in backlogged:
            return
        floor = min((self[t] for t in backlogged), default=self.last)
        self[tenant] = max(self[tenant], floor)

    def charge(self, tenant: int, n_tokens: int, weight: float) -> None:
        """``n_tokens`` served (prefilled, generated or embedded) to ``tenant`` of ``weight``."""
        self[tenant] += n_tokens / max(weight, 1e-6)
        self.last = self[tenant]
