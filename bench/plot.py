"""The picture of a ``bench/run_bench.sh --json`` result:

    python -m bench.plot RESULT.json OUT.png

Three panels: sustained requests/s and generated tokens/s per server (with the ceiling's
tokens/s as a line), p50 and p99 latency per server, and each request's time to first token
against when it was sent, over the run. Needs matplotlib (``pip install -e '.[bench]'``).
"""
from __future__ import annotations

import json
import sys


def plot(result: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    servers = dict(result["policies"])
    if result.get("peer"):
        servers["llama-server"] = result["peer"]
    names = list(servers)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [servers[n]["req_per_s"] for n in names], 0.4, label="requests/s")
    ax1.set_ylabel("requests/s")
    ax1b = ax1.twinx()
    ax1b.bar([i + 0.2 for i in x], [servers[n]["gen_tok_per_s"] for n in names], 0.4, color="tab:orange",
             label="generated tokens/s")
    ax1b.axhline(result["limit"]["gen_tok_per_s"], color="tab:red", linestyle="--", label="limit tokens/s")
    ax1b.set_ylabel("tokens/s")
    ax1.set_xticks(list(x), names)
    ax1.set_title(f"Throughput, {result['concurrency']} connections")
    handles = ax1.get_legend_handles_labels()[0] + ax1b.get_legend_handles_labels()[0]
    ax1.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=7)
    ax2.bar([i - 0.2 for i in x], [servers[n]["lat_p50_ms"] / 1000 for n in names], 0.4, label="p50")
    ax2.bar([i + 0.2 for i in x], [servers[n]["lat_p99_ms"] / 1000 for n in names], 0.4, label="p99")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("seconds")
    ax2.set_title("Latency per request")
    ax2.legend(fontsize=8)
    for n in names:
        points = [(s, t / 1000) for s, t in servers[n].get("samples", []) if t is not None]
        ax3.plot([p[0] for p in points], [p[1] for p in points], ".", label=n)
    ax3.set_xlabel("request sent (s into the run)")
    ax3.set_ylabel("time to first token (s)")
    ax3.set_title("Time to first token over the run")
    ax3.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"{m['model']} on {m['cpu']} ({m['cores']} cores, {m['threads']} threads)", fontsize=9, y=0.03)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=90)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        plot(json.load(f), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
