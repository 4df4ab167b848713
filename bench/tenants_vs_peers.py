"""Many tenants on one model: this server against llama-server alone and behind LiteLLM Proxy.

    python -m bench.tenants_vs_peers [--servers ours,llama-server,litellm] [--seconds 120]
                                     [--llama-server PATH] [--json out.json] [--png chart.png]

Every server runs the bundled SmolLM2-135M on the file ours computes with (its Q8_0 copy), 16
slots and 32,768 KV cells (ours' defaults; llama-server ``-np 16 -c 32768 --kv-unified
--kv-unified-per-slot 8192``, as ``bench.models``), one resident at a time, in the order given.

* ``ours``: the defaults plus a tenant file as an operator writes it (:data:`TENANTS`: a key per
  tenant, equal weights, ``E`` allowed the ``high`` class), nothing tuned to the run.
* ``llama-server``: no keys; first come, first served.
* ``litellm``: llama-server behind LiteLLM Proxy (:mod:`bench.litellm_proxy`), with a virtual
  key per tenant and the flooding tenant's key limited as its documentation says an operator
  protects the others (:data:`GATEWAY_LIMITS`: at most half the slots at once). Requests it
  refuses (429) are retried by the flood as the OpenAI SDK retries (:data:`RETRY_S`) and
  counted, not as errors.

Workloads, per server:

1. **Noisy neighbour** (streamed chat, temperature 0, ``ignore_eos``): tenant A keeps
   :data:`FLOOD_STREAMS` streams of :data:`FLOOD_TOKENS` tokens going, back to back; B, C and D
   each send a short question for :data:`LIGHT_TOKENS` tokens every :data:`PERIOD_S` seconds for
   ``--seconds``, open loop (a request is sent on time whether or not the last one answered);
   E sends the same at ``priority: "high"`` (the priority row; only ours has classes, the
   peers get E's requests without the field). The flood is cut when the window ends; a light
   request still waiting then gets :data:`DRAIN_S` more seconds without the flood, then is cut
   and counts its wait as its time to first token (both favour a server that kept it waiting).
   Reported: B–D's time to first token (the first chunk with content, from the request's send)
   p50 and p99 and tokens/s; E's the same; A's tokens/s; the total; errors; when the last light
   answer ended. Tokens/s count what arrived within the window, by re-tokenizing the text each
   stream received (one rule for every server: ours may put several tokens in a chunk).
2. **Shared prefixes**: four tenants, each its own system prompt of about
   :data:`SYSTEM_TOKENS` tokens; :data:`PREFIX_CLIENTS` clients (four a tenant) each hold a
   conversation of :data:`TURNS` turns (:data:`ANSWER_TOKENS` tokens an answer, the answer sent
   back in the next turn). Reported: time to first token p50/p99, requests/s, and the prompt
   tokens the server computed (ours: prompt less ``cached_tokens``; llama-server: its
   ``timings.prompt_n``). Ours and llama-server only (the gateway adds nothing to caching).

Exit status 1 when ours had an error. Figures and their reading: ``bench/RESULTS.md``, "Tenants".
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from bench.policies import percentile
from engine.config import EngineConfig

SERVERS = ("ours", "llama-server", "litellm")
LABELS = {"ours": "ours", "llama-server": "llama-server", "litellm": "LiteLLM Proxy + llama-server"}
#: The tenant file ours runs with: one key a tenant, equal weights, E's ceiling ``high``.
TENANTS = {"tenants": [{"id": t, "api_keys": [f"key-{t.lower()}"], **({"priority": "high"} if t == "E" else {})}
                       for t in "ABCDE"]}
#: The gateway's virtual keys (LiteLLM's ``/key/generate`` fields): the flood may hold half the slots.
GATEWAY_LIMITS = {"A": {"max_parallel_requests": EngineConfig.max_slots // 2}, "B": {}, "C": {}, "D": {}, "E": {}}
FLOOD_STREAMS, FLOOD_TOKENS = 32, 512
LIGHT, PRIORITY = ("B", "C", "D"), "E"
LIGHT_TOKENS, PERIOD_S = 64, 2.0
#: Seconds a flood stream waits after a 429 before it asks again: the OpenAI SDK's back-off
#: (0.5 s doubling to 8 s; the gateway's ``Retry-After: 60`` would idle it for a minute whatever
#: frees), reset by an admitted request.
RETRY_S, MAX_RETRY_S = 0.5, 8.0
SYSTEM_TOKENS, PREFIX_CLIENTS, TURNS, ANSWER_TOKENS = 1000, 16, 4, 32
MODEL_ID = "local-model"
#: Seconds the light tenants' requests still waiting when the window ends may take to start
#: answering; then they are cut, and their wait counts as their time to first token (a lower bound).
DRAIN_S = 20.0
#: Seconds a request may take before it counts as an error.
TIMEOUT_S = 600


@dataclass
class Answer:
    """One streamed chat answer: its tenant, when it was sent (``perf_counter``), the time to its
    first content (s, None if none came), the content received with each piece's arrival
    (``perf_counter``), the HTTP status (0: no response head), whether :func:`cut_all` ended it,
    whether it had no first token by then (``censored``: its ``ttft`` is its wait until the cut, a
    lower bound), the prompt's tokens and those of them the server reported computing (None: not
    reported)."""

    tenant: str
    sent: float
    ttft: float | None = None
    parts: list[tuple[float, str]] = field(default_factory=list)
    status: int = 0
    cut: bool = False
    censored: bool = False
    prompt: int | None = None
    computed: int | None = None
    error: str = ""

    @property
    def text(self) -> str:
        return "".join(c for _, c in self.parts)

    def text_until(self, t: float) -> str:
        """The content that arrived by ``t`` (``perf_counter``)."""
        return "".join(c for at, c in self.parts if at <= t)


@dataclass
class Target:
    """A server under test: its port, the key of each tenant (None: no keys), and whether it
    knows priority classes."""

    name: str
    port: int
    keys: dict[str, str] | None
    priorities: bool = False


def chat(target: Target, tenant: str, messages: list[dict], max_tokens: int, priority: str | None = None,
         conns: set | None = None) -> Answer:
    """Stream one chat answer. Its connection is in ``conns`` while it is open, so that
    :func:`cut_all` can end it (the text so far is kept)."""
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if priority and target.priorities:
        body["priority"] = priority
    headers = {"Content-Type": "application/json"}
    if target.keys:
        headers["Authorization"] = f"Bearer {target.keys[tenant]}"
    a = Answer(tenant, time.perf_counter())
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=TIMEOUT_S)
    if conns is not None:
        conns.add(conn)  # before it connects: cut_all retries until it can shut it
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        a.status = resp.status
        if resp.status != 200:
            a.error = resp.read()[:200].decode(errors="replace")
            return a
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if content:
                now = time.perf_counter()
                if a.ttft is None:
                    a.ttft = now - a.sent
                a.parts.append((now, content))
            a.computed = computed_tokens(chunk, a.computed)
            if chunk.get("usage"):
                a.prompt = chunk["usage"]["prompt_tokens"]
    except (OSError, http.client.HTTPException, ValueError) as e:
        a.error = a.error or f"{type(e).__name__}: {e}"
    finally:
        if conns is not None:
            conns.discard(conn)
        conn.close()
    return a


def computed_tokens(chunk: dict, known: int | None) -> int | None:
    """The prompt tokens a server computed, from a stream chunk: llama-server's
    ``timings.prompt_n``, else OpenAI's usage less ``prompt_tokens_details.cached_tokens``."""
    if "timings" in chunk:
        return chunk["timings"]["prompt_n"]
    usage = chunk.get("usage")
    if usage and known is None:
        return usage["prompt_tokens"] - ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return known


def cut_all(conns: set, threads: list[threading.Thread]) -> None:
    """End every stream of ``conns`` (its reader sees the connection close) until ``threads``,
    which stop sending once told, have ended: one may have sent a last request as it was told."""
    for th in threads:
        while th.is_alive():
            for conn in list(conns):
                with contextlib.suppress(OSError, AttributeError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            th.join(0.2)


def question(tenant: str, i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tenant {tenant}, question {i}: name three colours and say why you like them."}]


def story(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a very long story about ship number {i}, its crew and every port it saw."}]


def noisy_neighbour(target: Target, seconds: float, count_tokens, flood_streams: int = FLOOD_STREAMS,
                    flood_tokens: int = FLOOD_TOKENS, light_tokens: int = LIGHT_TOKENS) -> dict:
    """Workload 1 (see the module) against ``target``: its figures."""
    answers: list[Answer] = []
    refused = [0]
    lock = threading.Lock()
    window_over, drain_over = threading.Event(), threading.Event()
    flood_conns: set = set()
    light_conns: set = set()
    t0 = time.perf_counter()

    def flood(i: int) -> None:
        n, backoff = 0, RETRY_S
        while not window_over.is_set():
            a = chat(target, "A", story(i * 1000 + n), flood_tokens, conns=flood_conns)
            n += 1
            a.cut = window_over.is_set()  # its text so far counts; the cut is no error
            with lock:
                if a.status == 429:
                    refused[0] += 1
                else:
                    answers.append(a)
            if a.status == 429:
                window_over.wait(backoff)
                backoff = min(MAX_RETRY_S, 2 * backoff)
            else:
                backoff = RETRY_S

    def light(tenant: str, i: int, priority: str | None) -> None:
        a = chat(target, tenant, question(tenant, i), light_tokens, priority, light_conns)
        if drain_over.is_set() and a.status in (0, 200):
            a.cut = True
            if a.ttft is None:
                a.ttft, a.censored = time.perf_counter() - a.sent, True
        with lock:
            answers.append(a)

    floods = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(flood_streams)]
    for th in floods:
        th.start()
    lights = []
    tenants = LIGHT + (PRIORITY,)
    for i in range(max(1, int(seconds / PERIOD_S))):
        for k, tenant in enumerate(tenants):
            # The tenants' requests spread over the period, not sent in one burst.
            delay = t0 + i * PERIOD_S + k * PERIOD_S / len(tenants) - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=light, args=(tenant, i, "high" if tenant == PRIORITY else None), daemon=True)
            th.start()
            lights.append(th)
    delay = t0 + seconds - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    window_over.set()
    cut_all(flood_conns, floods)
    deadline = time.perf_counter() + DRAIN_S
    for th in lights:
        th.join(max(0.0, deadline - time.perf_counter()))
    drain_over.set()
    cut_all(light_conns, lights)
    return figures(answers, refused[0], t0, seconds, count_tokens)


def figures(answers: list[Answer], refused: int, t0: float, seconds: float, count_tokens) -> dict:
    """The noisy-neighbour figures from every answer of a window that began at ``t0``
    (``perf_counter``) and lasted ``seconds``: tokens/s count what arrived in the window."""
    def ttfts(tenants):
        return [a.ttft for a in answers if a.tenant in tenants and a.ttft is not None]

    def tok_per_s(tenants):
        return sum(count_tokens(a.text_until(t0 + seconds)) for a in answers if a.tenant in tenants) / seconds

    errors = [a for a in answers if not a.cut and (a.error or a.status != 200)]
    censored = sum(a.censored for a in answers)
    light, high = ttfts(LIGHT), ttfts((PRIORITY,))
    out = {"seconds": seconds, "light_last_answer_s": max((a.parts[-1][0] - t0 for a in answers
                                                            if a.tenant != "A" and a.parts), default=0.0),
           "light_ttft_p50_s": percentile(light, 50), "light_ttft_p99_s": percentile(light, 99),
           "light_answers": len(light), "light_tok_per_s": tok_per_s(LIGHT),
           "high_ttft_p50_s": percentile(high, 50), "high_ttft_p99_s": percentile(high, 99),
           "high_answers": len(high),
           "flood_tok_per_s": tok_per_s(("A",)), "flood_refused": refused,
           "errors": len(errors), "light_censored": censored, "error_samples": sorted({a.error[:120] for a in errors})[:3],
           "ttft_p99_s_by_tenant": {t: percentile(ttfts((t,)), 99) for t in LIGHT + (PRIORITY,)}}
    out["total_tok_per_s"] = out["flood_tok_per_s"] + out["light_tok_per_s"] + tok_per_s((PRIORITY,))
    return out


def preemptions(target: Target) -> float:
    """Ours' ``inference_preemptions_total`` (fair share and KV budget: docs/metrics.md); NaN for
    a peer."""
    if not target.priorities:
        return float("nan")
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("inference_preemptions_total"))


def system_prompt(tenant: int, tokens: int = SYSTEM_TOKENS) -> str:
    """Tenant ``tenant``'s system prompt: rules of its own, about ``tokens`` tokens (SmolLM2's
    tokenizer: a rule is 30 tokens)."""
    rules = " ".join(f"Rule {k} of team {tenant}: answer question {k} politely, cite source {tenant * 100 + k}, "
                     f"and never mention project {chr(65 + tenant)}{k}." for k in range(max(1, tokens // 30)))
    return f"You are the assistant of team {tenant}. {rules}"


def shared_prefixes(target: Target, clients: int = PREFIX_CLIENTS, turns: int = TURNS,
                    system_tokens: int = SYSTEM_TOKENS, answer_tokens: int = ANSWER_TOKENS) -> dict:
    """Workload 2 (see the module) against ``target``: its figures."""
    answers: list[Answer] = []
    lock = threading.Lock()
    names = ("A", "B", "C", "D")

    def client(i: int) -> None:
        tenant = i % len(names)
        messages = [{"role": "system", "content": system_prompt(tenant, system_tokens)}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Client {i}, turn {turn}: what does rule {turn + i} say?"})
            a = chat(target, names[tenant], messages, answer_tokens)
            with lock:
                answers.append(a)
            messages.append({"role": "assistant", "content": a.text})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t0
    ttft = [a.ttft for a in answers if a.ttft is not None]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "req_per_s": len(answers) / seconds, "requests": len(answers),
            "prompt_tokens": sum(a.prompt or 0 for a in answers),
            "prompt_tokens_computed": sum(a.computed or 0 for a in answers),
            "errors": sum(1 for a in answers if a.error)}


@contextlib.contextmanager
def serve(name: str, binary: str):
    """Start server ``name`` (see :data:`SERVERS`) on the bundled model; yields its :class:`Target`."""
    from bench.common import llama_server
    from bench.models import llama_server_flags
    from engine.config import default_model_path
    from engine.llama.weights import weights_path
    from tests.support.servers import running_server

    if name == "ours":
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(TENANTS, f)
            f.flush()
            with running_server("--tenants", f.name) as s:
                yield Target(name, s.port, {t["id"]: t["api_keys"][0] for t in TENANTS["tenants"]}, priorities=True)
        return
    with llama_server(binary, weights_path(default_model_path(), "auto"), *llama_server_flags(None)) as (port, _):
        if name == "llama-server":
            yield Target(name, port, None)
            return
        from bench.litellm_proxy import litellm_proxy

        with litellm_proxy(f"http://127.0.0.1:{port}/v1", MODEL_ID, GATEWAY_LIMITS) as (url, keys):
            yield Target(name, int(url.rsplit(":", 1)[1].split("/")[0]), keys)


def table(results: dict) -> str:
    """The noisy-neighbour and shared-prefix tables (Markdown) from ``results[server]``."""
    names = [s for s in SERVERS if s in results]
    rows = [("light tenants B–D: TTFT p50 (s)", "light_ttft_p50_s"), ("light tenants B–D: TTFT p99 (s)", "light_ttft_p99_s"),
            ("light tenants B–D: requests", "light_answers"), ("light tenants B–D: tok/s", "light_tok_per_s"),
            ("flooding tenant A: tok/s", "flood_tok_per_s"), ("flooding tenant A: requests refused (429)", "flood_refused"),
            ("total tok/s", "total_tok_per_s"), ("errors", "errors"),
            ("last light answer, s after the start", "light_last_answer_s"),
            (f"light requests with no token {DRAIN_S:.0f} s after the window (TTFT: their wait, a lower bound)",
             "light_censored"),
            ("preemptions (ours: fair share of slots and KV budget)", "preemptions"),
            ("priority row: E's `high` requests, TTFT p50 (s)", "high_ttft_p50_s"),
            ("priority row: E's `high` requests, TTFT p99 (s)", "high_ttft_p99_s")]
    out = ["Noisy neighbour", "", "| measure | " + " | ".join(LABELS[s] for s in names) + " |",
           "|---" * (len(names) + 1) + "|"]
    for label, key in rows:
        out.append(f"| {label} | " + " | ".join(fmt(results[s]["noisy"].get(key, float("nan"))) for s in names) + " |")
    if "ours" in results:
        ours = results["ours"]["noisy"]
        for peer in names[1:]:
            p = results[peer]["noisy"]
            out.append(f"\nours ÷ {LABELS[peer]}: light TTFT p99 {ratio(ours['light_ttft_p99_s'], p['light_ttft_p99_s'])}, "
                       f"total tok/s {ratio(ours['total_tok_per_s'], p['total_tok_per_s'])}")
    prefix = [s for s in names if "prefix" in results[s]]
    if prefix:
        out += ["", "Shared prefixes", "", "| measure | " + " | ".join(LABELS[s] for s in prefix) + " |",
                "|---" * (len(prefix) + 1) + "|"]
        for label, key in [("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p99 (s)", "ttft_p99_s"), ("requests/s", "req_per_s"),
                           ("prompt tokens sent", "prompt_tokens"), ("prompt tokens computed", "prompt_tokens_computed"),
                           ("errors", "errors")]:
            out.append(f"| {label} | " + " | ".join(fmt(results[s]["prefix"][key]) for s in prefix) + " |")
    return "\n".join(out)


def fmt(v: float) -> str:
    """A figure as :func:`bench.models.number` prints it; ``n/a`` for NaN (no answer to take a
    percentile of)."""
    from bench.models import number

    return "n/a" if v != v else number(v)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def plot(results: dict, out: str, flood_streams: int = FLOOD_STREAMS) -> None:
    """TTFT p99 per tenant per server (log scale): the chart the README links."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s in SERVERS if s in results]
    tenants = LIGHT + (PRIORITY,)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        values = [results[name]["noisy"]["ttft_p99_s_by_tenant"][t] for t in tenants]
        bars = ax.bar([g + k * width for g in range(len(tenants))], values, width, label=LABELS[name])
        ax.bar_label(bars, [f"{v:.1f}" for v in values], fontsize=7)
    ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(tenants))],
                  [f"tenant {t}" + (" (priority high)" if t == PRIORITY else "") for t in tenants])
    ax.set_ylabel("time to first token, p99 (s)")
    ax.set_yscale("log")
    ax.set_title(f"Tenant A floods {flood_streams} streams; B–E ask every {PERIOD_S:.0f} s "
                 f"(SmolLM2-135M, {EngineConfig.max_slots} slots; the peers' bars are lower bounds)", fontsize=9)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    from bench.common import save
    from bench.models import DEFAULT_LLAMA_SERVER
    from engine.config import default_model_path
    from engine.llama.tokenizer import Tokenizer

    p = argparse.ArgumentParser(prog="python -m bench.tenants_vs_peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--seconds", type=float, default=120.0, help="how long the light tenants keep asking")
    p.add_argument("--flood-streams", type=int, default=FLOOD_STREAMS)
    p.add_argument("--flood-tokens", type=int, default=FLOOD_TOKENS)
    p.add_argument("--light-tokens", type=int, default=LIGHT_TOKENS)
    p.add_argument("--prefix-clients", type=int, default=PREFIX_CLIENTS)
    p.add_argument("--turns", type=int, default=TURNS)
    p.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA_SERVER))
    p.add_argument("--json")
    p.add_argument("--png")
    a = p.parse_args(argv)
    servers = a.servers.split(",")
    unknown = set(servers) - set(SERVERS)
    if unknown:
        p.error(f"--servers: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SERVERS)})")
    if set(servers) - {"ours"} and not os.access(a.llama_server, os.X_OK):
        p.error(f"--llama-server: no executable at {a.llama_server} (bench/README.md builds one)")
    from bench import litellm_proxy
    if "litellm" in servers and not litellm_proxy.available():
        p.error("--servers litellm: no LiteLLM Proxy (bench/litellm_proxy.py says how to install it), "
                "or leave it out: --servers ours,llama-server")
    tokenizer = Tokenizer(default_model_path())

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_bos=False)) if text else 0

    results = {}
    for name in servers:
        started = time.perf_counter()
        with serve(name, a.llama_server) as target:
            chat(target, "B", question("B", -1), 4)  # warm-up
            before = preemptions(target)
            results[name] = {"noisy": noisy_neighbour(target, a.seconds, count_tokens, a.flood_streams,
                                                      a.flood_tokens, a.light_tokens)}
            results[name]["noisy"]["preemptions"] = preemptions(target) - before
            if name != "litellm":
                results[name]["prefix"] = shared_prefixes(target, a.prefix_clients, a.turns, a.system_tokens)
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(table(results))
    save(results, a.json)
    if a.png:
        plot(results, a.png, a.flood_streams)
    ours = results.get("ours", {})
    return 1 if ours.get("noisy", {}).get("errors") or ours.get("prefix", {}).get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
