"""The metrics a Gateway API Inference Extension endpoint picker (EPP) routes on, read from the
engines' control blocks at scrape time (docs/operations.md "Kubernetes routing with the Inference
Extension"; the manifests in ``k8s/inference-extension/``).

The EPP scrapes every ready pod of its ``InferencePool`` and keeps, per pod, the values the
Inference Extension's model server protocol names: requests waiting (TotalQueuedRequests),
requests running (TotalRunningRequests), the KV cache's utilization (KVCacheUtilization, 0-1) and,
for model-aware routing, an info gauge whose labels list the models ("adapters") the pod serves.
It reads one series per metric and pod: with no label matcher in its configuration, the first of a
family. So each quantity comes twice:

- per model, labelled ``model`` (a name clients send; aliases of one model repeat its engine's
  values), for an ``InferencePool`` per model whose EPP selects ``{model="..."}``;
- per replica, without labels, over the replica's distinct engines, for one pool routing every
  model: waiting and running requests summed, KV utilization the fullest engine's (a replica is
  as full as its fullest KV cache for the requests that model receives).

The info gauge ``inference_replica_models_info`` follows vLLM's ``vllm:lora_requests_info``, which
the EPP's ``lora-affinity-scorer`` reads: ``running_lora_adapters`` lists the names whose engine
is ready, ``waiting_lora_adapters`` those whose engine is starting or restarting, ``max_lora``
the number of names (the server loads no model at run time, so a pod that lists neither scores 0
for a name), and its value is the time of the scrape (the EPP keeps the series with the latest).

Labels stay bounded: model names come from the operator's configuration.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

from engine.client import EngineClient

#: Per model (label ``model``) and per replica (no label): requests waiting for a KV slot.
MODEL_WAITING, REPLICA_WAITING = "inference_model_waiting_requests", "inference_replica_waiting_requests"
#: Sequences holding a KV slot (decoding or prefilling).
MODEL_RUNNING, REPLICA_RUNNING = "inference_model_running_requests", "inference_replica_running_requests"
#: KV cells the running sequences hold or are promised, over the engine's ``--kv-cache-tokens``.
MODEL_KV, REPLICA_KV = "inference_model_kv_cache_utilization", "inference_replica_kv_cache_utilization"
#: The names served, as vLLM's LoRA info gauge lists adapters.
MODELS_INFO = "inference_replica_models_info"
#: The LoRA info gauge's labels, as the EPP reads them (its ``running_lora_adapters`` ...).
INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
#: Every family :class:`PoolCollector` yields.
FAMILIES = (MODEL_WAITING, MODEL_RUNNING, MODEL_KV, REPLICA_WAITING, REPLICA_RUNNING, REPLICA_KV, MODELS_INFO)


@dataclass(frozen=True)
class EngineLoad:
    """One engine as of its last step.

    Attributes:
        waiting: sequences queued for a KV slot. running: sequences holding one. kv_cells: KV cells
        the running sequences hold or are promised. kv_budget: the engine's ``--kv-cache-tokens``
        (None: not known, so no utilization). ready: the engine serves (loaded, stepping).
    """

    waiting: int
    running: int
    kv_cells: int
    kv_budget: int | None
    ready: bool

    @property
    def kv_utilization(self) -> float | None:
        """KV cells in use over the budget, 0-1 (None without a budget)."""
        if not self.kv_budget:
            return None
        return min(1.0, self.kv_cells / self.kv_budget)

    @classmethod
    def of(cls, engine: EngineClient, kv_budget: int | None) -> "EngineLoad":
        snap = engine.snapshot()
        return cls(snap.n_waiting, sum(1 for m in snap.slot_mailbox if m >= 0), snap.kv_cells, kv_budget,
                   engine.ready())


class PoolCollector:
    """Collector of the EPP's metrics (see the module's docstring and docs/metrics.md).

    Args:
        engines: the engine of each name clients send as ``model`` (every alias of a model, so the
            info gauge lists every name the EPP may be asked for; aliases share their client).
        kv_cache_tokens: each engine's KV cell budget (``--kv-cache-tokens``), by name or one for
            all (under any of a model's names); the control block does not carry it. None, or
            none of an engine's names: no KV utilization for that engine (an embedding engine
            keeps no KV cache).
    """

    def __init__(self, engines: Mapping[str, EngineClient], kv_cache_tokens: int | Mapping[str, int] | None = None):
        self.engines = dict(engines)
        self.kv_cache_tokens = kv_cache_tokens

    def _budget(self, name: str | None) -> int | None:
        if isinstance(self.kv_cache_tokens, Mapping):
            return self.kv_cache_tokens.get(name)
        return self.kv_cache_tokens

    def loads(self) -> tuple[dict[str, EngineLoad], list[EngineLoad]]:
        """Each name's engine load, and each distinct engine's once (one snapshot an engine)."""
        budgets: dict[int, int | None] = {}  # an engine's budget: given under any of its names
        for name, engine in self.engines.items():
            budgets[id(engine)] = budgets.get(id(engine)) or self._budget(name)
        by_engine: dict[int, EngineLoad] = {}
        named = {}
        for name, engine in self.engines.items():
            if id(engine) not in by_engine:
                by_engine[id(engine)] = EngineLoad.of(engine, budgets[id(engine)])
            named[name] = by_engine[id(engine)]
        return named, list(by_engine.values())

    def collect(self):
        named, distinct = self.loads()
        if named:
            waiting = GaugeMetricFamily(MODEL_WAITING, "Requests (sequences: n choices are n) waiting for a KV slot "
                                        "in the model's engine, as of its last step", labels=["model"])
            running = GaugeMetricFamily(MODEL_RUNNING, "Sequences holding a KV slot of the model's engine, as of "
                                        "its last step", labels=["model"])
            kv = GaugeMetricFamily(MODEL_KV, "KV cells the model's running sequences hold or are promised, over "
                                   "its --kv-cache-tokens (0-1), as of its last step", labels=["model"])
            for name, load in named.items():
                waiting.add_metric([name], load.waiting)
                running.add_metric([name], load.running)
                if load.kv_utilization is not None:
                    kv.add_metric([name], load.kv_utilization)
            yield waiting
            yield running
            if kv.samples:
                yield kv
        if distinct:
            yield GaugeMetricFamily(REPLICA_WAITING, "Requests waiting for a KV slot in any engine of this replica",
                                    value=sum(d.waiting for d in distinct))
            yield GaugeMetricFamily(REPLICA_RUNNING, "Sequences holding a KV slot in any engine of this replica",
                                    value=sum(d.running for d in distinct))
            known = [d.kv_utilization for d in distinct if d.kv_utilization is not None]
            if known:
                yield GaugeMetricFamily(REPLICA_KV, "KV cache utilization (0-1) of this replica's fullest engine",
                                        value=max(known))
        if named:
            running_names = [name for name, load in named.items() if load.ready]
            waiting_names = [name for name, load in named.items() if not load.ready]
            info = GaugeMetricFamily(MODELS_INFO, "The model names this replica serves, as vLLM's LoRA info gauge "
                                     "lists adapters: running (engine ready), waiting (engine starting); value: "
                                     "the scrape's time", labels=list(INFO_LABELS))
            info.add_metric([",".join(running_names), ",".join(waiting_names), str(len(named))], time.time())
            yield info
