"""The metrics a Gateway API Inference Extension endpoint picker routes on
(server/observability/pool_metrics.py): per model and per replica, read from the engines' control
blocks at scrape time, equal to what the engines hold, on a real server's /metrics too."""
from __future__ import annotations

import contextlib
import pathlib
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.request import SamplingParams
from server.observability.metrics import Scrape
from server.observability.pool_metrics import (FAMILIES, INFO_LABELS, MODEL_KV, MODEL_RUNNING, MODEL_WAITING,
                                               MODELS_INFO, REPLICA_KV, REPLICA_RUNNING, REPLICA_WAITING, PoolCollector)
from shm.control import Snapshot
from tests.support.http import COMPLETIONS, get, open_stream

ROOT = pathlib.Path(__file__).resolve().parents[2]


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(found: dict, name: str, **labels) -> float:
    (v,) = [v for (n, ls), v in found.items() if n == name and ls == frozenset(labels.items())]
    return v


def info_labels(found: dict) -> dict[str, str]:
    (labels,) = [dict(ls) for (n, ls), _ in found.items() if n == MODELS_INFO]
    return labels


class FakeEngine:
    """What the collector reads of an engine client: its control block's snapshot, and readiness."""

    def __init__(self, slots: list[int], waiting: int, kv_cells: int, ready: bool = True):
        self.snap = Snapshot(1, slots, [-1] * len(slots), waiting, kv_cells=kv_cells)
        self.is_ready = ready
        self.snapshots = 0

    def snapshot(self) -> Snapshot:
        self.snapshots += 1
        return self.snap

    def ready(self) -> bool:
        return self.is_ready


def collected(collector: PoolCollector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    return samples(generate_latest(registry).decode())


def test_per_model_series_and_the_replica_over_distinct_engines():
    chat = FakeEngine([4, -1, 7, -1], waiting=3, kv_cells=600)
    embed = FakeEngine([-1, 2], waiting=1, kv_cells=0, ready=False)
    small = FakeEngine([1], waiting=0, kv_cells=900)
    # A budget given under one name of a model (its id) holds for its aliases too.
    found = collected(PoolCollector({"smollm2": chat, "local-model": chat, "embed": embed, "tiny": small},
                                    {"local-model": 2000, "tiny": 1000}))
    # Aliases repeat their engine's values; the replica counts each engine once.
    for name in ("smollm2", "local-model"):
        assert value(found, MODEL_WAITING, model=name) == 3 and value(found, MODEL_RUNNING, model=name) == 2
        assert value(found, MODEL_KV, model=name) == 0.3
    assert value(found, MODEL_WAITING, model="embed") == 1 and value(found, MODEL_RUNNING, model="embed") == 1
    assert not [k for k in found if k[0] == MODEL_KV and ("model", "embed") in k[1]]  # no budget, no utilization
    assert chat.snapshots == 1  # one snapshot an engine and scrape
    assert value(found, REPLICA_WAITING) == 4 and value(found, REPLICA_RUNNING) == 4
    assert value(found, REPLICA_KV) == 0.9  # the fullest engine's
    # The LoRA-style info gauge: ready engines' names running, the restarting one's waiting.
    labels = info_labels(found)
    assert set(labels) == set(INFO_LABELS)
    assert labels == {"running_lora_adapters": "smollm2,local-model,tiny", "waiting_lora_adapters": "embed",
                      "max_lora": "4"}
    (stamp,) = [v for (n, _), v in found.items() if n == MODELS_INFO]
    assert abs(stamp - time.time()) < 60  # the scrape's time: the picker keeps the latest series


def test_one_engine_under_one_name_gives_the_replica_the_same_values():
    engine = FakeEngine([3, -1], waiting=2, kv_cells=100)
    found = collected(PoolCollector({"m": engine}, None))
    assert value(found, REPLICA_WAITING) == value(found, MODEL_WAITING, model="m") == 2
    assert value(found, REPLICA_RUNNING) == 1 and REPLICA_KV not in {n for n, _ in found}
    found = collected(PoolCollector({"m": engine}, 400))
    assert value(found, REPLICA_KV) == value(found, MODEL_KV, model="m") == 0.25


def test_every_family_is_documented():
    page = (ROOT / "docs/metrics.md").read_text()
    for name in FAMILIES:
        assert f"`{name}`" in page, name


@contextlib.contextmanager
def submitted(client, n: int, max_new_tokens: int):
    streams = [client.submit([600 + i, 601, 602], SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                                                                  ignore_eos=True)) for i in range(n)]
    try:
        yield streams
    finally:
        for s in streams:
            s.close()


def wait_for(condition, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)
    return got


def test_the_scrape_reads_the_engine_while_its_slots_are_full(app):
    """Scrape given the engines by name (as a multi-model app passes them): every slot taken and
    two sequences waiting, the series equal the engine's control block."""
    client = app.engine
    budget = app.config.engine_config().kv_cache_tokens
    app.wait_idle()
    scrape = Scrape({"smollm2": client}, names={"smollm2": client, "local-model": client}, kv_cache_tokens=budget)
    idle = samples(scrape.render().decode())
    assert value(idle, MODEL_WAITING, model="smollm2") == value(idle, REPLICA_WAITING) == 0
    assert value(idle, MODEL_KV, model="local-model") == value(idle, REPLICA_KV) == 0
    assert info_labels(idle)["running_lora_adapters"] == "smollm2,local-model"
    with submitted(client, client.max_slots + 2, max_new_tokens=400):
        wait_for(lambda: client.snapshot().n_waiting == 2 and -1 not in client.snapshot().slot_mailbox)
        before = client.snapshot()
        found = samples(scrape.render().decode())
        after = client.snapshot()
    for name in ("smollm2", "local-model"):
        assert value(found, MODEL_WAITING, model=name) == 2
        assert value(found, MODEL_RUNNING, model=name) == client.max_slots
    assert value(found, REPLICA_WAITING) == 2 and value(found, REPLICA_RUNNING) == client.max_slots
    assert 0 < before.kv_cells / budget <= value(found, MODEL_KV, model="smollm2") <= after.kv_cells / budget <= 1
    assert value(found, REPLICA_KV) == value(found, MODEL_KV, model="smollm2")
    assert value(found, "inference_queue_depth", model="smollm2") == 2  # the engine's own gauge agrees
    app.wait_idle()


def test_a_running_servers_metrics_count_the_waiting_requests(single):
    """A real server (gunicorn, engine process; one slot, one queue place): while its slot is taken
    and a request waits, /metrics says so. The per-replica series come from the one engine, the
    per-model ones name every served name."""
    body = {"prompt": "Once", "max_tokens": 200, "stream": True, "ignore_eos": True}
    idle = samples(get(single, "/metrics").body.decode())
    assert value(idle, REPLICA_WAITING) == 0 and value(idle, REPLICA_RUNNING) == 0
    with open_stream(single, COMPLETIONS, body, timeout=60) as first:
        assert first.status == 200
        first.readline()
        with open_stream(single, COMPLETIONS, body, timeout=60) as second:
            assert second.status == 200
            wait_for(lambda: single.engine.snapshot().n_waiting == 1)
            found = samples(get(single, "/metrics").body.decode())
            assert single.engine.snapshot().n_waiting == 1  # still: the scrape saw this state
    cards = get(single, "/v1/models").json()["data"]
    served = {m["id"] for m in cards}
    assert value(found, REPLICA_WAITING) == 1 == value(found, "inference_queue_depth", model=cards[0]["root"])
    assert value(found, REPLICA_RUNNING) == 1
    per_model = {dict(ls)["model"]: v for (n, ls), v in found.items() if n == MODEL_WAITING}
    assert set(per_model) == served and all(v == 1 for v in per_model.values())
    assert set(info_labels(found)["running_lora_adapters"].split(",")) == served
    for (n, _), v in found.items():
        if n in (REPLICA_KV, MODEL_KV):
            assert 0 < v <= 1
    single.wait_idle()
