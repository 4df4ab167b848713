"""``python -m bench.soak``: how it classifies outcomes, and a soak of the real server (workers,
engine, gRPC sidecar, one engine and one worker SIGKILL) that must leave nothing behind and grow no
process's RSS by more than 10 %. It lasts ``SOAK_MINUTES`` (default 0.5, a developer's `make test`;
CI's .ci/run sets 2), each process's RSS judged from a quarter of the run (at most 15 s, bench.soak's
default warm-up) after it appeared."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.soak import Result, classify


def _result(kind: str, start: float, end: float, raw: str, status: int | None = 200, code: str | None = None,
            detail: str = "") -> Result:
    r = Result(kind, start)
    r.end = end
    return r.set(raw, status, code, detail)


def test_engine_errors_are_expected_only_while_the_engine_was_down():
    down, kills = [(40.0, 44.0)], []
    assert classify(_result("chat", 39, 41, "status", 503, "engine_unavailable"), down, kills) \
        == "503_engine_restarting"
    assert classify(_result("chat_stream", 30, 40.2, "stream_error", 200, "engine_unavailable"), down, kills) \
        == "503_engine_restarting"
    assert classify(_result("chat", 50, 51, "status", 503, "engine_unavailable"), down, kills) \
        == "unexpected_503_engine_unavailable"
    assert classify(_result("chat", 50, 51, "status", 503, "server_overloaded"), down, kills) == "503_saturated"
    assert classify(_result("chat", 50, 51, "status", 500, None), down, kills) == "unexpected_500"


def test_cut_connections_are_expected_only_at_the_worker_kill():
    kills = [80.0]
    assert classify(_result("chat", 79, 80.1, "conn_error", None), [], kills) == "worker_killed"
    assert classify(_result("chat_stream", 79, 80.1, "bad_response", 200, None, "stream ended without [DONE]"),
                    [], kills) == "worker_killed"
    assert classify(_result("chat", 85, 86, "conn_error", None), [], kills) == "unexpected_conn_error"
    assert classify(_result("chat", 85, 146, "timeout", None), [], kills) == "unexpected_timeout"


def test_refusals_count_as_expected_only_for_requests_built_for_them():
    assert classify(_result("bad_json", 1, 2, "status", 400), [], []) == "client_error_400"
    assert classify(_result("chat", 1, 2, "status", 400), [], []) == "unexpected_400"
    assert classify(_result("bad_json", 1, 2, "ok"), [], []) == "unexpected_200_for_bad_json"
    assert classify(_result("over_quota", 1, 2, "status", 429), [], []) == "rate_limited_429"
    assert classify(_result("over_quota", 1, 2, "ok"), [], []) == "ok"  # its bucket had a token
    assert classify(_result("chat", 1, 2, "status", 429), [], []) == "unexpected_429"
    assert classify(_result("disconnect_mid_stream", 1, 2, "disconnect", None), [], []) == "client_disconnect"
    assert classify(_result("chat", 1, 2, "disconnect", None), [], []) == "unexpected_disconnect"


def test_soak_leaves_nothing_behind(tmp_path):
    out = tmp_path / "soak.json"
    minutes = os.environ.get("SOAK_MINUTES", "0.5")
    warmup_s = min(15.0, float(minutes) * 60 / 4)  # the replacement worker, killed at 2/3, is judged too
    run = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", minutes, "--warmup-s", str(warmup_s),
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["passed"] and not res["failures"] and not res["unexpected"]
    assert not any(k.startswith("unexpected") for k in res["outcomes"])
    assert all(res["outcomes"].get(k, 0) > 0 for k in ("ok", "client_disconnect", "client_error_400",
                                                      "rate_limited_429", "503_engine_restarting")), res["outcomes"]
    assert [e["what"] for e in res["events"]] == ["engine_sigkill", "worker_sigkill"]
    assert res["end_state"]["mailboxes_in_use"] == 0 and res["end_state"]["slots_in_use"] == 0
    assert res["shm"]["left_after_shutdown"] == [] and res["processes_left"] == [] and res["master_exit"] == 0
    judged = [row for row in res["rss"] if row["judged"]]
    assert {row["role"] for row in judged} >= {"master", "worker", "engine", "sidecar"}
    assert all(row["growth"] <= 0.10 for row in judged), judged
    os.unlink(res["server_log"])  # kept by bench.soak for its reader; a failed run keeps it here too
