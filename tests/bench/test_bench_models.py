"""The model side-by-side (bench/models.py): its medians, ratios and goals, and the process-tree
memory it reports (bench/common.py). The bench itself is not run here: at its smallest (ours on
SmolLM2, ``--only memory``) it took 24 s in a busy suite."""
from __future__ import annotations

import os
import signal
import subprocess

from bench.common import tree_memory
from bench.models import summary, table


def test_medians_and_ratios_within_the_run_and_each_round():
    runs = {"ours": {"fixed": [{"tok_per_s": 100.0}, {"tok_per_s": 120.0}, {"tok_per_s": 90.0}],
                     "memory": [{"after_pss_mib": 500.0}, {"after_pss_mib": 510.0}, {"after_pss_mib": 520.0}]},
            "llama-server": {"fixed": [{"tok_per_s": 100.0}, {"tok_per_s": 100.0}, {"tok_per_s": 120.0}],
                             "memory": [{"after_pss_mib": 400.0}, {"after_pss_mib": 400.0}, {"after_pss_mib": 400.0}]}}
    s = summary(runs)
    assert s["medians"]["ours"]["fixed"]["tok_per_s"] == 100.0
    assert s["ratios"]["fixed"]["tok_per_s"] == 1.0 and s["ratios"]["memory"]["after_pss_mib"] == 1.275
    assert s["ratios_by_round"]["fixed"]["tok_per_s"] == [1.0, 1.2, 0.75]
    text = table("M", {"file": "/x/m.gguf", "rounds": 3, **s})
    assert "| generated tok/s, 16 streams | 100 | 100 | 1.000 | 1.000, 1.200, 0.750 | ≥ 0.97 ×: met |" in text
    assert "| PSS after traffic, process tree (MiB) | 510 | 400 | 1.275 |" in text and "≤ 1.1 ×: NOT met" in text
    assert "requests/s" not in text  # a workload that did not run has no row


def test_one_server_has_no_ratio_columns():
    s = summary({"ours": {"cold": [{"ms": 12.5}]}})
    assert "ratios" not in s
    assert table("M", {"file": "m.gguf", "rounds": 1, **s}).splitlines()[2:] == [
        "| measure | ours |", "|---|---|", "| cold 1,440-token prompt, time to first token (ms) | 12.5 |"]


def test_tree_memory_counts_every_descendant():
    # bash, the sleep it started and a bash of its own, whose sleep is started before it says
    # "up": four processes on three levels.
    proc = subprocess.Popen(["bash", "-c", "sleep 30 & bash -c 'sleep 30 & echo up; wait'; wait"],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline() == b"up\n"
        tree = tree_memory(proc.pid)
        assert tree["processes"] == 4 and 0 < tree["pss_mib"] <= tree["rss_mib"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

