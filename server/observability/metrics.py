"""Prometheus metrics of the front ends, and the scrape (``GET /metrics``).

The names and bucket boundaries are a contract with dashboards and alerts (docs/metrics.md
lists them; ``docker/grafana`` queries them). The engine's own step histograms are in
:mod:`engine.metrics`. Under gunicorn every process writes its values to
``PROMETHEUS_MULTIPROC_DIR`` (:mod:`server.observability.metrics_dir`) and any process can serve the sum.

Three gauges are not recorded by anyone but read at scrape time from the engine's control block
(:class:`EngineStateCollector`): the slot table and queue as of the engine's last step, and its
state. They are exact at the moment Prometheus samples them, cost the engine loop nothing, and
need no multiprocess mode (no process holds a value that could go stale when it dies). So are
the series a Gateway API Inference Extension endpoint picker routes on, per model and per replica
(:mod:`server.observability.pool_metrics`).

Buckets fit CPU inference of a small model (seconds unless said):

- end-to-end latency: 50 ms to 10 min (a 2,048-token answer at 5 tok/s takes about 7 min);
- time to first token and queue wait: 5 ms to 5 min (a long prompt behind a full queue);
- inter-token latency: 1 ms to 5 s (one decode step of a batch, up to a stalled engine).
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

import falcon
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from engine.client import EngineClient
from server.control.store import ControlUnavailable, month_of
from server.observability import metrics_dir
from server.observability.pool_metrics import PoolCollector

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)

REQUESTS = Counter("inference_requests", "Finished requests (HTTP status or gRPC code; finish reason of choice 0)",
                   ["tenant", "route", "status", "finish_reason"])
LATENCY = Histogram("inference_latency_seconds", "End to end: request received to answer complete",
                    ["route", "finish_reason"], buckets=LATENCY_BUCKETS)
QUEUE_WAIT = Histogram("inference_queue_wait_seconds", "Submitted to admitted into a KV slot (choice 0)",
                       buckets=WAIT_BUCKETS)
TIME_TO_FIRST_TOKEN = Histogram("inference_time_to_first_token_seconds",
                                "Request received to its first generated token reaching the front end",
                                buckets=WAIT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("inference_inter_token_latency_seconds",
                                "Gap between consecutive tokens of one choice, as the front end receives them",
                                buckets=INTER_TOKEN_BUCKETS)
PROMPT_TOKENS = Counter("inference_prompt_tokens", "Prompt tokens of submitted requests (usage.prompt_tokens)",
                        ["tenant"])
CACHED_PROMPT_TOKENS = Counter("inference_cached_prompt_tokens",
                               "Prompt tokens reused from the prefix cache (usage...cached_tokens)", ["tenant"])
GENERATED_TOKENS = Counter("inference_generated_tokens", "Generated tokens (usage.completion_tokens)", ["tenant"])
DEADLINE_EXCEEDED = Counter("inference_requests_deadline_exceeded",
                            "Requests that reached their deadline (finish_reason deadline or DEADLINE_EXCEEDED)",
                            ["tenant"])
RATE_LIMITED = Counter("inference_requests_rate_limited", "Requests refused with 429 / RESOURCE_EXHAUSTED",
                       ["tenant", "kind"])
ENGINE_RESTARTS = Counter("inference_engine_restarts", "Engine processes started again after a crash or stall",
                          ["model"])


class EngineStateCollector:
    """Collector of each model's engine, labelled ``model`` (its id; bounded: the operator's
    models): ``inference_kv_slot_utilization`` (busy slots / slots, 0-1),
    ``inference_kv_cells`` (KV cells the running sequences hold or are promised),
    ``inference_preemptions_total`` (sequences requeued for the KV budget or a tenant's fair
    share of slots), ``inference_queue_depth`` (sequences waiting for a slot) and
    ``inference_engine_up`` (1 when the engine is ready), read from the control blocks at scrape
    time.

    Args:
        engines: model id -> its engine's client.
    """

    def __init__(self, engines: Mapping[str, EngineClient]):
        self.engines = dict(engines)

    def collect(self):
        slots = GaugeMetricFamily("inference_kv_slot_utilization", "Busy KV slots / slots, as of the last engine step",
                                  labels=["model"])
        cells = GaugeMetricFamily("inference_kv_cells", "KV cells the running sequences hold or are promised "
                                  "(at most --kv-cache-tokens), as of the last engine step", labels=["model"])
        preemptions = CounterMetricFamily("inference_preemptions", "Running sequences preempted and requeued: "
                                          "growing sequences outgrew --kv-cache-tokens, or a tenant below its fair "
                                          "share of the slots took one", labels=["model"])
        queued = GaugeMetricFamily("inference_queue_depth", "Sequences waiting for a KV slot, as of the last engine "
                                   "step", labels=["model"])
        up = GaugeMetricFamily("inference_engine_up", "1 when the engine process is ready", labels=["model"])
        for model, engine in self.engines.items():
            snap = engine.snapshot()
            slots.add_metric([model], sum(1 for m in snap.slot_mailbox if m >= 0) / len(snap.slot_mailbox))
            cells.add_metric([model], snap.kv_cells)
            preemptions.add_metric([model], snap.preemptions)
            queued.add_metric([model], snap.n_waiting)
            up.add_metric([model], int(engine.ready()))
        yield from (slots, cells, preemptions, queued, up)


class ProjectCollector:
    """Collector of each active project's month (UTC), read from the control plane at scrape
    time: ``inference_project_spend_cents`` (spent), ``inference_project_spend_limit_cents`` (the
    projects with a spend limit), ``inference_project_tokens`` (input + output tokens). Labelled
    by project id (bounded: a server holds at most 10,000 projects, ``server/control/admin.py``).
    Nothing is yielded while the state cannot be read."""

    def __init__(self, control):
        self.control = control

    def collect(self):
        state = self.control.state
        projects = sorted({*state.tenants, *state.file.by_id})  # the store's active projects and the file's
        try:
            spends = self.control.store.spends(projects, month_of(time.time()))
        except ControlUnavailable:
            return
        spent = GaugeMetricFamily("inference_project_spend_cents", "Cents a project spent this UTC month",
                                  labels=["project"])
        limit = GaugeMetricFamily("inference_project_spend_limit_cents", "A project's spend limit, cents a month",
                                  labels=["project"])
        tokens = GaugeMetricFamily("inference_project_tokens", "Input and output tokens a project used this UTC month",
                                   labels=["project"])
        for project in projects:
            spend = spends[project]
            spent.add_metric([project], spend.spent / 10_000_000)
            tokens.add_metric([project], spend.tokens)
            doc = state.doc("spend_limit", project)
            if doc:
                limit.add_metric([project], doc["threshold_amount"])
        yield from (spent, limit, tokens)


class Scrape:
    """``GET /metrics``: every process's metrics added up (Prometheus text format 0.0.4). Needs
    no API key, but an admin key when ``admin`` (admin keys are configured and the metrics
    share the public port: they name the projects). Outside multiprocess mode (an app in one
    process), this process's registry.

    Args:
        engines: model id -> its engine's client (:class:`EngineStateCollector`).
        control: the control plane, for the projects' months (None: none).
        names: each name clients send as ``model`` -> its engine's client, aliases included,
            for the endpoint picker's per-model series and its info gauge
            (:class:`~server.observability.pool_metrics.PoolCollector`). None: ``engines``.
        kv_cache_tokens: the engines' ``--kv-cache-tokens`` (one for all, or by name), which the
            KV utilization needs; None: no KV utilization series.
    """

    def __init__(self, engines: Mapping[str, EngineClient], control=None, admin: bool = False,
                 names: Mapping[str, EngineClient] | None = None,
                 kv_cache_tokens: int | Mapping[str, int] | None = None):
        self.public, self.admin = not admin, admin
        self.path = os.environ.get(metrics_dir.ENV)
        self.registry = CollectorRegistry()
        if self.path:
            MultiProcessCollector(self.registry, self.path)
        self.registry.register(EngineStateCollector(engines))
        # The Inference Extension's endpoint picker reads these (server/observability/pool_metrics.py):
        # per model name, and per replica over the distinct engines.
        self.registry.register(PoolCollector(names if names is not None else engines, kv_cache_tokens))
        if control is not None:  # the control plane (server/control/state.py): the projects' months
            self.registry.register(ProjectCollector(control))

    def render(self) -> bytes:
        if not self.path:
            return generate_latest(REGISTRY) + generate_latest(self.registry)
        with metrics_dir.read_lock(self.path):
            return generate_latest(self.registry)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = self.render()
