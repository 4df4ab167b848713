"""This server against llama.cpp's ``llama-server`` on each model family under test, side by side
(issue 47): the same GGUF, the same slots and context, alternating rounds, medians.

    python -m bench.models [--models smollm2,gemma] [--rounds 2] [--llama-server PATH]
                           [--servers ours,llama-server] [--only fixed,mix,...] [--json out.json]

Models: ``smollm2`` (the bundled SmolLM2-135M-Instruct) and ``gemma`` (Gemma 3 270M, a base
model: ``tests.support.model.gemma_path()``). Gemma's GGUF has no chat template, so on it both
servers get its turn format's template (``tests.support.model.GEMMA_TEMPLATE``: ours
``--chat-template``, llama-server ``--jinja --chat-template-file``) for the one workload that
chats (``structured``); the others are completions. Ours serves Gemma with its JSON separators
(``tests.support.model.GEMMA_SEPARATORS``).

Servers, one resident at a time (each is started for its turn of a round and stopped after it,
so no other server shares the CPUs or the weights' page cache while one is measured; the order
alternates between rounds):

* ``ours``: the defaults (16 slots, ``kv_cache_tokens`` 32,768, ``max_seq_len`` 8,192: the
  :class:`engine.config.EngineConfig` defaults; 2 workers; the gRPC sidecar on) but ``--model``.
* ``llama-server``: its defaults but ``-np 16 -c 32768 --kv-unified --kv-unified-per-slot 8192``
  and ``-t`` one per CPU (:func:`bench.common.llama_server`), on the file ours computes with
  (``weights_path(model, "auto")``: the Q8_0 copy of SmolLM2's Q4_1 file, Gemma's Q4_K_M file as
  it is). ``--kv-unified`` makes its 32,768 cells one pool that any slot may fill, as ours
  admits sequences against ``kv_cache_tokens``, and ``--kv-unified-per-slot`` caps a slot at
  ours' ``max_seq_len``; without them each slot would own 32,768 / 16 = 2,048 cells.

Workloads (each server's turn runs them in this order, after a 4-token warm-up; the first four
are ``bench.prefill``'s, with prompts new to every turn so no prefix cache is hit):

* ``cold``: one 1,440-token prompt, ``max_tokens`` 1, on the fresh server: time to that first
  (and only) token (ms, the unstreamed answer's).
* ``stream``: one stream of 512 tokens (``ignore_eos``): tokens/s.
* ``fixed``: 16 clients, 48 requests of a 32-token prompt and 128 tokens: generated tokens/s.
* ``mix``: 16 clients, 64 requests of ``bench.policies.workload`` (70 % short and 30 % long
  prompts, log-normal ``max_tokens`` up to 400, ``ignore_eos``), streamed: requests/s (and
  generated tokens/s) while every client was busy.
* ``structured``: ``bench.json_corpus``'s structured-output corpus (chat, temperature 0, 200
  tokens): the share of answers valid and stopped, the derailed ones, and of them the given
  objects answered nested deeper (the issue's derailment, ``bench.json_corpus``'s ``deeper``).
* ``memory``: the whole process tree's resident memory (:func:`bench.common.tree_memory`: RSS
  and PSS summed over every descendant, MiB; ours is the gunicorn master, its workers, the
  engine and the gRPC sidecar, llama-server one process) after start (healthy, before any
  request), and after traffic: the turn's workloads, then 16 concurrent requests (a 64-token
  prompt, 32 tokens) so every slot has held a sequence, once the server is idle.

Figures are the medians over ``--rounds``; the table prints ours ÷ llama-server of the medians,
the same ratio within each round (the spread is the machine's noise), and issue 47's goals
(tok/s with 16 streams ≥ 0.97 ×, the mix's requests/s ≥ 1.1 ×, PSS after traffic ≤ 1.1 ×,
valid-and-stopped share ≥ 1 ×, no given object nested deeper). Exit status 1 when a request failed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

from bench.common import llama_server, save, tree_memory
from bench.http import throughput
from bench.prefill import Prompts, completion, run_cold, run_fixed, run_mix, run_stream
from engine.config import EngineConfig

MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma": "Gemma 3 270M"}
SERVERS = ("ours", "llama-server")
WORKLOADS = ("cold", "stream", "fixed", "mix", "structured", "memory")
#: Where bench/README.md's recipe builds llama-server (``$LLAMA_SERVER`` wins).
DEFAULT_LLAMA_SERVER = "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
#: The model id the structured-output corpus asks for: ours' default (llama-server takes any).
MODEL_ID = "local-model"
#: The traffic that ends a turn before its last memory sample: every slot holds a sequence once.
FILL_PROMPT_TOKENS, FILL_TOKENS = 64, 32


@dataclass(frozen=True)
class Up:
    """A started server: its HTTP port, the pid at the root of its process tree, and a call that
    returns once it is idle."""

    port: int
    pid: int
    settle: Callable[[], None]


@dataclass(frozen=True)
class Measure:
    """One row of the table: ``workload``'s figure ``key``, its label, and issue 47's goal if it
    has one (its text and a check of ours' median against llama-server's)."""

    workload: str
    key: str
    label: str
    goal: str = ""
    met: Callable[[float, float], bool] | None = None


MEASURES = (
    Measure("fixed", "tok_per_s", "generated tok/s, 16 streams", "≥ 0.97 ×", lambda o, p: o >= 0.97 * p),
    Measure("mix", "req_per_s", "heavy-tailed mix, requests/s", "≥ 1.1 ×", lambda o, p: o >= 1.1 * p),
    Measure("mix", "gen_tok_per_s", "heavy-tailed mix, generated tok/s"),
    Measure("stream", "tok_per_s", "one stream, tok/s"),
    Measure("cold", "ms", "cold 1,440-token prompt, time to first token (ms)"),
    Measure("memory", "start_rss_mib", "RSS after start, process tree (MiB)"),
    Measure("memory", "start_pss_mib", "PSS after start, process tree (MiB)"),
    Measure("memory", "after_rss_mib", "RSS after traffic, process tree (MiB)"),
    Measure("memory", "after_pss_mib", "PSS after traffic, process tree (MiB)", "≤ 1.1 ×", lambda o, p: o <= 1.1 * p),
    Measure("memory", "processes", "processes in the tree"),
    Measure("structured", "valid_and_stopped_share", "structured outputs, valid and stopped (share)", "≥ 1 ×",
            lambda o, p: o >= p),
    Measure("structured", "derailed", "structured outputs, derailed answers (to max_tokens, deeper or a key repeated)"),
    Measure("structured", "deeper_given", "structured outputs, given objects nested deeper (the issue's derailment)",
            "ours 0", lambda o, p: o == 0),
)


def model_files(name: str) -> tuple[str, str | None]:
    """Model ``name``'s GGUF and the chat template file both servers get (None: the file's own)."""
    from engine.config import default_model_path
    from tests.support.model import GEMMA_TEMPLATE, gemma_path

    return (default_model_path(), None) if name == "smollm2" else (gemma_path(), GEMMA_TEMPLATE)


def llama_server_flags(template: str | None) -> list[str]:
    """llama-server's flags beyond its defaults: ours' slots and context (see the module)."""
    return (["-np", str(EngineConfig.max_slots), "-c", str(EngineConfig.kv_cache_tokens), "--kv-unified",
             "--kv-unified-per-slot", str(EngineConfig.max_seq_len)]
            + (["--jinja", "--chat-template-file", template] if template else []))


@contextlib.contextmanager
def serve(server: str, path: str, template: str | None, binary: str):
    """Start ``server`` (``ours`` or ``llama-server``) on the model at ``path``; yields its :class:`Up`."""
    from engine.llama.weights import weights_path
    from tests.support.model import GEMMA_SEPARATORS, gemma_path
    from tests.support.servers import running_server

    if server == "ours":
        own = (["--chat-template", template] if template else []) + \
            (["--json-separators", GEMMA_SEPARATORS] if path == gemma_path() else [])
        with running_server("--model", path, *own, grpc=True) as s:
            yield Up(s.port, s.proc.pid, s.wait_idle)
    else:
        with llama_server(binary, weights_path(path, "auto"), *llama_server_flags(template)) as (port, proc):
            yield Up(port, proc.pid, lambda: None)  # it answered every request: nothing runs on


def run_structured(port: int) -> dict:
    """The structured-output corpus (``bench/json_corpus.py``) against the server at ``port``: its
    requests, the share of them valid and stopped, and the derailed ones."""
    from bench import json_corpus

    r = json_corpus.run(f"http://127.0.0.1:{port}", MODEL_ID)
    return {"total": r["total"], "valid_and_stopped_share": r["valid_and_stopped"] / r["total"],
            "derailed": r["derailed"], "deeper_given": r["by_kind"]["given"]["deeper"]}


RUNS = {"cold": run_cold, "stream": run_stream, "fixed": run_fixed, "mix": run_mix}


def turn(up: Up, names: list[str], prompts: Prompts) -> dict:
    """One server's turn of a round: the workloads ``names`` in :data:`WORKLOADS`' order,
    each's figures by name."""
    out = {}
    start = tree_memory(up.pid) if "memory" in names else None
    completion(up.port, "warm up", 4)
    for w in (w for w in WORKLOADS if w in names):
        if w in RUNS:
            out[w] = RUNS[w](up.port, prompts)
        elif w == "structured":
            out[w] = run_structured(up.port)
    if start is not None:
        throughput(up.port, [prompts.make(FILL_PROMPT_TOKENS) for _ in range(EngineConfig.max_slots)], FILL_TOKENS)
        up.settle()
        after = tree_memory(up.pid)
        out["memory"] = {"start_rss_mib": start["rss_mib"], "start_pss_mib": start["pss_mib"],
                         "after_rss_mib": after["rss_mib"], "after_pss_mib": after["pss_mib"],
                         "processes": after["processes"]}
    return out


def summary(runs: dict) -> dict:
    """From ``runs[server][workload]`` (one figures dict a round): the medians by server,
    workload and figure; ours ÷ llama-server of the medians; and that ratio within each round."""
    medians = {s: {w: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
                   for w, rounds in by_w.items() if rounds} for s, by_w in runs.items()}
    out = {"medians": medians}
    if set(SERVERS) <= set(runs):
        ours, peer = runs["ours"], runs["llama-server"]
        out["ratios"] = {w: {k: v / medians["llama-server"][w][k] for k, v in figures.items()
                             if medians["llama-server"][w][k]} for w, figures in medians["ours"].items()}
        out["ratios_by_round"] = {w: {k: [a[k] / b[k] for a, b in zip(ours[w], peer[w]) if b[k]] for k in ours[w][0]}
                                  for w in ours if ours[w]}
    return out


def number(v: float) -> str:
    """A figure as the table prints it: whole numbers as such, others to 1 decimal (2 under 10)."""
    return f"{int(v):,}" if v == int(v) else f"{v:,.{2 if abs(v) < 10 else 1}f}"


def table(label: str, result: dict) -> str:
    """The model's figures as a Markdown table (see the module); the ratio columns only when both
    servers ran."""
    medians, ratios, by_round = result["medians"], result.get("ratios"), result.get("ratios_by_round", {})
    servers = [s for s in SERVERS if s in medians]
    lines = [f"{label} ({os.path.basename(result['file'])}), medians of {result['rounds']} rounds", "",
             "| measure | " + " | ".join(servers) + (" | ours ÷ llama-server | by round | goal |" if ratios else " |"),
             "|---|" + "---|" * (len(servers) + (3 if ratios else 0))]
    for m in MEASURES:
        values = [medians[s].get(m.workload, {}).get(m.key) for s in servers]
        if all(v is None for v in values):
            continue
        row = [m.label] + ["" if v is None else number(v) for v in values]
        if ratios:
            ours, peer = values[0], values[1]
            ratio = ratios.get(m.workload, {}).get(m.key)
            met = m.met and ours is not None and peer is not None and m.met(ours, peer)
            row += ["" if ratio is None else f"{ratio:.3f}",
                    ", ".join(f"{x:.3f}" for x in by_round.get(m.workload, {}).get(m.key, [])),
                    f"{m.goal}: {'met' if met else 'NOT met'}" if m.met else ""]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from engine.llama.tokenizer import Tokenizer
    from engine.llama.weights import weights_path

    p = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or DEFAULT_LLAMA_SERVER,
                   help="the llama-server binary (default: %(default)s: $LLAMA_SERVER if set, else where "
                        "bench/README.md's recipe builds it)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of " + ", ".join(SERVERS))
    p.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads, of " + ", ".join(WORKLOADS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    models, servers, names = (a.models.split(","), a.servers.split(","), a.only.split(","))
    for given, known, flag in ((models, MODELS, "--models"), (servers, SERVERS, "--servers"),
                               (names, WORKLOADS, "--only")):
        if not given or any(x not in known for x in given):
            p.error(f"{flag} takes a comma-separated list of {', '.join(known)}")
    if "llama-server" in servers and not os.access(a.llama_server, os.X_OK):
        p.error(f"no llama-server at {a.llama_server}: build it (bench/README.md), pass --llama-server, "
                "or --servers ours")
    if "structured" in names and importlib.util.find_spec("bench.json_corpus") is None:
        p.error("the structured workload needs bench/json_corpus.py")
    result = {"rounds": a.rounds, "servers": servers, "workloads": names, "cpus": len(os.sched_getaffinity(0)),
              "slots": EngineConfig.max_slots, "kv_cache_tokens": EngineConfig.kv_cache_tokens,
              "max_seq_len": EngineConfig.max_seq_len, "models": {}}
    errors = 0
    for model in models:
        path, template = model_files(model)
        prompts = Prompts(Tokenizer(path))
        runs = {s: {w: [] for w in names} for s in servers}
        for r in range(a.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                with serve(s, path, template, a.llama_server) as up:
                    figures = turn(up, names, prompts)
                for w, f in figures.items():
                    runs[s][w].append(f)
                    errors += f.get("errors", 0)
                print(f"round {r + 1} {model} {s}: {json.dumps(figures)}", flush=True)
        one = {"file": path, "weights_file": weights_path(path, "auto"), "chat_template": template,
               "rounds": a.rounds, "llama_server_flags": llama_server_flags(template), "runs": runs, **summary(runs)}
        result["models"][model] = one
        print("\n" + table(MODELS[model], one) + "\n", flush=True)
    save(result, a.json)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
