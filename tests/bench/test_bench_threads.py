"""``python -m bench.threads``: its settling arithmetic, and that ``--quick`` runs (CI checks
only that; the figures come from full runs, docs/performance.md "Threads")."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.threads import settle


def test_settle_is_the_time_to_reach_the_new_level():
    bins = [200, 200, 200, 60, 90, 120, 118, 122, 120, 121, 119, 120]
    assert settle(bins, change=2.5, until=11) == 3.5  # bin 5 (120) is the first at the new level
    assert settle([100] * 10, change=3.2, until=9) == pytest.approx(1.8) # the first whole bin after it (4) ends at 5


def test_quick_run(tmp_path):
    out = tmp_path / "threads.json"
    # The default setting only (adaptive: no ceiling of its own), on the fixed workload, idle, in a
    # suite whose other files keep the CPUs busy: the suite's time goes to what can fail here
    # (errors, restarts, the output's shape). The comparison between settings and conditions is
    # the full run's; an engine started beside a busy process is tests/e2e/test_resilience.py's.
    subprocess.run([sys.executable, "-m", "bench.threads", "--quick", "--settings", "adaptive", "--no-mix",
                    "--conditions", "idle", "--json", str(out)], check=True, timeout=900,
                   stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert list(result["settings"]) == ["adaptive (default)"]
    assert all(v > 0 for row in result["settings"].values() for v in row.values())
    assert list(result["settings"]["adaptive (default)"]) == ["idle fixed tok/s"]
    assert not any(result["errors"].values()) and not any(result["restarts"].values()), result
    assert result["switch"]["tokens_per_s_bins"]
