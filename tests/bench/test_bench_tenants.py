"""The many-tenants benchmark (bench/tenants_vs_peers.py): its counting rules, its tables, and
the benchmark end to end on ours at a small size (a real server with its tenant file: keys,
the ``high`` class, the flood cut when the light tenants are answered)."""
from __future__ import annotations

import json

import pytest

from bench.tenants_vs_peers import Answer, computed_tokens, figures, main, table


def test_computed_prompt_tokens_from_either_servers_chunks():
    assert computed_tokens({"timings": {"prompt_n": 12, "cache_n": 988}}, None) == 12
    usage = {"usage": {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 960}}}
    assert computed_tokens(usage, None) == 40
    assert computed_tokens({"usage": {"prompt_tokens": 7}}, None) == 7
    assert computed_tokens(usage, 12) == 12  # llama-server's timings came first and win
    assert computed_tokens({"choices": []}, None) is None


def test_figures_split_tenants_count_the_window_and_errors():
    answers = [Answer("A", 0, 0.5, [(0.5, "x" * 20), (1.9, "x" * 10), (2.5, "x" * 50)], 200, cut=True),
               Answer("A", 0, None, [], 0, cut=True, error="RemoteDisconnected"),
               Answer("B", 0, 1.0, [(1.0, "x" * 4)], 200), Answer("C", 0, 3.0, [(3.0, "x" * 4)], 200),
               Answer("D", 0, None, [], 503, error="server busy"), Answer("E", 0, 0.2, [(0.2, "x" * 2)], 200),
               Answer("B", 1.0, 22.0, [], 0, cut=True, censored=True, error="RemoteDisconnected")]
    f = figures(answers, refused=5, t0=0.0, seconds=2.0, count_tokens=len)
    assert f["light_answers"] == 3 and f["light_ttft_p99_s"] == pytest.approx(21.62) and f["light_censored"] == 1
    assert f["light_tok_per_s"] == 2.0  # C's answer came after the window: its TTFT counts, its tokens do not
    assert f["high_answers"] == 1 and f["high_ttft_p50_s"] == 0.2
    assert f["flood_tok_per_s"] == 15.0 and f["flood_refused"] == 5
    assert f["total_tok_per_s"] == 18.0 and f["light_last_answer_s"] == 3.0
    assert f["errors"] == 1 and f["error_samples"] == ["server busy"]  # a cut flood stream is none


def test_table_has_a_column_per_server_and_the_ratios():
    noisy = {"light_ttft_p50_s": 0.5, "light_ttft_p99_s": 1.0, "light_answers": 180, "light_tok_per_s": 20.0,
             "flood_tok_per_s": 100.0, "flood_refused": 0, "total_tok_per_s": 130.0, "errors": 0, "light_last_answer_s": 121.0,
             "high_ttft_p50_s": 0.2, "high_ttft_p99_s": 0.4}
    results = {"ours": {"noisy": noisy, "prefix": {"ttft_p50_s": 0.1, "ttft_p99_s": 0.3, "req_per_s": 4.0,
                                                    "prompt_tokens": 9000, "prompt_tokens_computed": 5000, "errors": 0}},
               "llama-server": {"noisy": {**noisy, "light_ttft_p99_s": 20.0, "total_tok_per_s": 130.0}}}
    text = table(results)
    assert "| light tenants B–D: TTFT p99 (s) | 1 | 20 |" in text
    assert "ours ÷ llama-server: light TTFT p99 0.050, total tok/s 1.000" in text
    assert "| prompt tokens computed | 5,000 |" in text  # only ours ran the shared prefixes


def test_the_benchmark_on_ours_at_a_small_size(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--servers", "ours", "--seconds", "2", "--flood-streams", "2", "--flood-tokens", "16",
                 "--light-tokens", "4", "--prefix-clients", "8", "--turns", "2", "--system-tokens", "60",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())["ours"]
    noisy, prefix = r["noisy"], r["prefix"]
    assert noisy["errors"] == 0 and noisy["light_answers"] == 3 and noisy["high_answers"] == 1
    # Tokens count only what arrived in the 2 s window: in a busy suite that may be none.
    assert noisy["total_tok_per_s"] >= noisy["flood_tok_per_s"] + noisy["light_tok_per_s"]
    assert noisy["preemptions"] >= 0
    # Eight clients of four tenants, two turns: a tenant's system prompt is computed once, and a
    # second turn computes only what it added, so far fewer tokens are computed than sent.
    assert prefix["requests"] == 16 and prefix["errors"] == 0
    assert 0 < prefix["prompt_tokens_computed"] < 0.6 * prefix["prompt_tokens"]
    assert "| light tenants B–D: TTFT p99 (s) |" in capsys.readouterr().out
