"""The policy benchmark's own arithmetic and workload (bench/policies.py), and its measure of the
physical limit on a short mix, and the benchmark itself (``bench/run_bench.sh``) end to end on a
small workload."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench.policies import Sample, percentile, ratios, summarize, workload

ROOT = Path(__file__).resolve().parents[2]


def test_workload_is_deterministic_for_a_seed_and_heavy_tailed():
    a, b, c = workload(200, 7), workload(200, 7), workload(200, 8)
    assert a == b and a != c
    lengths = sorted(r.max_tokens for r in a)
    assert 4 <= lengths[0] and lengths[-1] <= 400
    assert lengths[-10] > 4 * lengths[100]  # the tail: the top 5 % are several times the median
    words = [len(r.prompt.split()) for r in a]
    assert {min(words), max(words)} == {18, 152}  # "Request i:" + 16 or 150 words
    assert 0.55 < sum(w == 18 for w in words) / len(words) < 0.85


@pytest.mark.parametrize("values", [[5.0], [1, 2, 3, 4], list(range(1, 101)), [3, 1, 2, 10, 7, 7]])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_is_numpys_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summarize_counts_errors_apart():
    samples = [Sample(0, 10, 100, 5), Sample(0, 20, 300, 7), Sample(1, None, None, 0, "HTTP 503")]
    s = summarize(samples, wall_s=2.0)
    assert s["req_per_s"] == 1.0 and s["gen_tok_per_s"] == 6.0 and s["errors"] == 1
    assert s["lat_p50_ms"] == 200 and s["ttft_p99_ms"] == pytest.approx(19.9)


def test_ratios():
    policies = {"continuous": {"req_per_s": 4.0, "gen_tok_per_s": 170.0, "lat_p50_ms": 500},
                "static": {"req_per_s": 2.0, "gen_tok_per_s": 100.0, "lat_p50_ms": 1000},
                "fifo": {"req_per_s": 1.0, "gen_tok_per_s": 60.0, "lat_p50_ms": 200}}
    r = ratios(policies, limit_tok_per_s=200.0, shape_tok_per_s=250.0)
    assert r["continuous/fifo_req_per_s"] == 4.0 and r["static/fifo_req_per_s"] == 2.0
    assert r["continuous/static_req_per_s"] == 2.0 and r["continuous/static_lat_p50"] == 0.5
    assert r["continuous/limit_gen_tok_per_s"] == 0.85 and r["fifo/limit_gen_tok_per_s"] == 0.3
    assert r["continuous/limit_mean_shape_gen_tok_per_s"] == 0.68


def test_the_replayed_ceiling_generates_exactly_the_lists_tokens():
    from bench.limit import measure_mix
    from engine.config import default_model_path

    requests = [([1, 504, 1234], 5), ([1] + [600] * 70, 1), ([1, 42], 9), ([1, 77, 78, 79], 3)]
    r = measure_mix(default_model_path(), 2, requests, threads=1)
    assert r["generated"] == 5 + 1 + 9 + 3 and r["requests"] == 4
    assert 0 < r["busy_s"] <= r["seconds"] and r["tokens_per_s"] > 0


def test_run_bench_end_to_end(tmp_path):
    """``bench/run_bench.sh`` as a user runs it, on a workload small enough for the suite (four
    requests, two at a time: some 20 s here): every policy answers every request, and the
    ceiling it is set against was measured."""
    out = tmp_path / "bench.json"
    subprocess.run([str(ROOT / "bench" / "run_bench.sh"), "--requests", "4", "--concurrency", "2", "--slots", "2",
                    "--json", str(out)], check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"continuous", "static", "fifo"} and result["limit"]["gen_tok_per_s"] > 0
    for p in result["policies"].values():
        assert p["errors"] == 0 and p["req_per_s"] > 0


def test_sustained_rates_count_only_the_busy_window():
    samples = [Sample(0.0, 100, 1000, 3, arrivals=(0.1, 0.5, 1.0)),   # done at 1.0 s
               Sample(0.0, 100, 3000, 4, arrivals=(0.1, 1.5, 2.5, 3.0)),  # done at 3.0 s
               Sample(1.0, 100, 500, 2, arrivals=(1.2, 1.5))]  # done at 1.5 s
    s = summarize(samples, wall_s=3.0, busy_s=2.0)
    assert s["req_per_s"] == 2 / 2.0  # two answered within the first 2 s
    assert s["gen_tok_per_s"] == (3 + 2 + 2) / 2.0  # tokens that arrived by then
    assert s["whole_run"] == {"req_per_s": 1.0, "gen_tok_per_s": 3.0}
