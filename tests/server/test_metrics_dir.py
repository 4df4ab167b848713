"""The multiprocess metrics directory (server/observability/metrics_dir.py): a dead process's
counts retired into the retired files, the scrape's totals unchanged."""
from __future__ import annotations


def test_retire_adds_a_dead_process_counts_into_the_retired_files(tmp_path):
    """Raw per-key sums: what a scrape would add up, before and after, is the same."""
    from prometheus_client.mmap_dict import MmapedDict
    from prometheus_client.multiprocess import MultiProcessCollector

    from server.observability import metrics_dir

    def write(name, values):
        d = MmapedDict(str(tmp_path / name))
        for key, v in values.items():
            d.write_value(key, v, 0.0)
        d.close()

    key = '["inference_requests", "inference_requests_total", {"route": "/x"}, "h"]'
    bucket = '["inference_latency_seconds", "inference_latency_seconds_bucket", {"le": "1.0"}, "h"]'
    write("counter_111.db", {key: 3.0})
    write("counter_222.db", {key: 4.0})
    write("histogram_111.db", {bucket: 2.0})
    write("counter_retired.db", {key: 10.0})
    (tmp_path / ".lock").touch()

    def totals():
        return {s.name: s.value for m in MultiProcessCollector(None, str(tmp_path)).collect() for s in m.samples}

    before = totals()
    metrics_dir.retire(111, str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.db")) == ["counter_222.db", "counter_retired.db",
                                                             "histogram_retired.db"]
    assert totals() == before and before["inference_requests_total"] == 17.0
