"""The AMX probe of engine/llama/library.py: what a probe process's end counts as (faults, runs,
hangs)."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("end, outcome", [
    ("SIGILL", "faults"),  # tilezero an invalid opcode (one kind of VM)
    ("SIGSEGV", "faults"),  # ldtilecfg a general protection fault (another): "runs" was said there
    ("SIGBUS", "faults"),
    ("SIGTERM", "runs"), ("raise", "runs"), ("return", "runs"),
    ("hang", "hangs"),  # a forked probe once deadlocked under pytest-xdist: the start waited forever
])
def test_the_amx_probe_counts_every_fault_signal_and_nothing_else(end, outcome):
    import sys

    from engine.llama.library import run_outcome

    body = {"raise": "raise RuntimeError('llama.cpp refused the model')", "return": "pass",
            "hang": "import time; time.sleep(60)"}.get(
        end, f"import os, signal; os.kill(os.getpid(), signal.{end})")
    assert run_outcome([sys.executable, "-c", body], timeout_s=2.0) == outcome
