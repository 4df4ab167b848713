"""Multi-node: nginx from the shipped template (``docker/nginx/nginx.conf.template``, run by
``tests/support/nginx.py``) in front of one and of three replicas, and least connections against
consistent hashing on multi-turn conversations, in one run.

    python -m bench.multinode [--clients 12 --requests 48 --rounds 1 --parts all] [--json out.json]

Starts three real replicas on 127.0.0.2, .3 and .4 (4 slots, 1024 tokens, one worker, the
default adaptive compute threads, a tenant file of three tenants; the three engines share this
machine's CPUs), then:

* proxy cost: one stream at a time (``max_tokens`` 4), alternating, straight to replica 1 and
  through nginx to replica 1 alone (the template's three upstream lines all naming it); 10 of
  each: time to first token p50 of each and the difference.
* scaling: ``--requests`` streaming chat completions (each its own question, ``max_tokens`` 32
  with ``ignore_eos``, greedy) from ``--clients`` concurrent clients, through nginx to replica 1
  alone, then to all three: requests/s, time to first token p50 and p95.
* affinity: three tenants, each with its own system prompt (about 250 tokens) and three
  conversations of six turns (the whole history sent every turn, ``max_tokens`` 24), nine
  clients at once; nginx with ``least_conn``, then with ``hash $affinity consistent`` (on the
  ``X-Conversation-ID`` header each conversation sends), ``--rounds`` times, alternating. Every
  run has new system prompts, so none finds an earlier run's cache. Cached prompt tokens
  (``usage.prompt_tokens_details.cached_tokens``) over prompt tokens, time to first token p50,
  requests/s, and how many requests each replica served.
"""
from __future__ import annotations

import collections
import json
import statistics
import sys
import tempfile

from bench.common import concurrently, save
from bench.prefix import QUESTIONS, SYSTEM, chat_stream
from tests.support.nginx import AFFINITY, LEAST_CONN, Nginx
from tests.support.servers import RunningServer, running_replicas

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
TENANTS = 3
FLAGS = ("--max-slots", "4", "--max-seq-len", "1024", "--workers", "1", "--no-metrics")


def auth(tenant: int, conversation: str = "-") -> dict:
    return {"Authorization": f"Bearer key-{tenant}", "X-Conversation-ID": conversation}


def p50_ms(results: list[dict]) -> float:
    return statistics.median(r["ttft"] for r in results) * 1000


def proxy_cost(proxy: Nginx, replica: RunningServer, n: int = 10) -> dict:
    """TTFT p50 (ms) straight to ``replica`` and through ``proxy`` (which balances onto it alone)."""
    direct, through = [], []
    for i in range(n):  # each its own prompt (no cache hit on the other's), each first in turn
        def straight():
            direct.append(chat_stream(replica.port, [{"role": "user", "content": f"Say hello, take {2 * i}."}], 4,
                                      headers=auth(0), host=replica.host))

        def proxied():
            through.append(chat_stream(proxy.port, [{"role": "user", "content": f"Say hello, take {2 * i + 1}."}], 4,
                                       headers=auth(0)))
        for send in (straight, proxied) if i % 2 == 0 else (proxied, straight):
            send()
    return {"direct_ttft_p50_ms": p50_ms(direct), "proxy_ttft_p50_ms": p50_ms(through),
            "added_ms": p50_ms(through) - p50_ms(direct)}


def spread(proxy: Nginx, clients: int, requests: int, salt: str) -> dict:
    """Independent questions from ``clients`` at once: requests/s and TTFT p50, p95 (ms)."""
    results = []

    def work(i):
        for r in range(i, requests, clients):
            messages = [{"role": "user", "content": f"{QUESTIONS[r % len(QUESTIONS)]} (case {salt}-{r})"}]
            results.append(chat_stream(proxy.port, messages, 32, headers=auth(r % TENANTS)))

    wall = concurrently(clients, work)
    ttfts = sorted(r["ttft"] for r in results)
    return {"requests_per_s": len(results) / wall, "ttft_p50_ms": p50_ms(results),
            "ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))] * 1000}


def conversations(proxy: Nginx, salt: str, per_tenant: int = 3, turns: int = 6) -> dict:
    """Every tenant's ``per_tenant`` conversations at once, ``turns`` turns each."""
    results = []

    def work(i):
        tenant, c = divmod(i, per_tenant)
        headers = auth(tenant, f"{salt}-{tenant}-{c}")
        messages = [{"role": "system", "content": f"Desk {tenant}, session {salt}. {SYSTEM}"}]
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[(i + turn) % len(QUESTIONS)]})
            r = chat_stream(proxy.port, messages, 24, headers=headers)
            results.append(r)
            messages.append({"role": "assistant", "content": r["text"]})

    wall = concurrently(TENANTS * per_tenant, work)
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results)
    served = collections.Counter(e["upstreams"][-1] for e in proxy.logged(salt, len(results)))
    return {"requests_per_s": len(results) / wall, "ttft_p50_ms": p50_ms(results), "prompt_tokens": prompt,
            "cached_tokens": cached, "prefilled_tokens": prompt - cached, "cached_share": cached / prompt,
            "requests_per_replica": sorted(served.values())}


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.multinode", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1, help="affinity runs of each balancing, alternating")
    p.add_argument("--parts", choices=("all", "scaling", "affinity"), default="all",
                   help="scaling: the proxy's cost and one against three replicas; affinity: the balancings")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as tenants:
        json.dump({"tenants": [{"id": f"t{i}", "api_keys": [f"key-{i}"]} for i in range(TENANTS)]}, tenants)
        tenants.flush()
        with running_replicas(HOSTS, *FLAGS, "--tenants", tenants.name) as replicas:
            for r in replicas:  # a first decode pays once for the memory it touches first
                chat_stream(r.port, [{"role": "user", "content": "Hi"}], 4, headers=auth(0), host=r.host)
            results = {}
            if a.parts in ("all", "scaling"):
                results.update(scaling(replicas, a.clients, a.requests))
            if a.parts in ("all", "affinity"):
                results["affinity"] = affinity(replicas, a.rounds)
    save(results, a.json)
    return 0


def scaling(replicas: list[RunningServer], clients: int, requests: int) -> dict:
    """The proxy's cost, then :func:`spread` through nginx to replica 1 alone and to all three."""
    results = {}
    for name, upstreams in (("one_replica", [replicas[0]] * 3), ("three_replicas", replicas)):
        proxy = Nginx(upstreams)
        try:
            if name == "one_replica":
                results["proxy_cost"] = cost = proxy_cost(proxy, replicas[0])
                print(f"proxy: TTFT p50 direct {cost['direct_ttft_p50_ms']:.1f} ms, through nginx "
                      f"{cost['proxy_ttft_p50_ms']:.1f} ms ({cost['added_ms']:+.1f} ms)")
            results[name] = r = spread(proxy, clients, requests, name)
        finally:
            proxy.stop()
        print(f"{name}: {r['requests_per_s']:.2f} req/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
              f"p95 {r['ttft_p95_ms']:.0f} ms")
    print(f"three / one: {results['three_replicas']['requests_per_s'] / results['one_replica']['requests_per_s']:.2f}x "
          "req/s")
    return results


def affinity(replicas: list[RunningServer], rounds: int) -> dict:
    """:func:`conversations` under ``least_conn`` and under consistent hashing, alternating."""
    runs = {"least_conn": [], "hash": []}
    for k in range(rounds):
        for name, balance in (("least_conn", LEAST_CONN), ("hash", AFFINITY)):
            proxy = Nginx(replicas, balance)
            try:
                runs[name].append(r := conversations(proxy, f"r{k}{name}-"))
            finally:
                proxy.stop()
            for replica in replicas:
                replica.wait_idle()
            print(f"{name}: cached {r['cached_tokens']}/{r['prompt_tokens']} prompt tokens ({r['cached_share']:.1%}; "
                  f"{r['prefilled_tokens']} prefilled), TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                  f"{r['requests_per_s']:.2f} req/s, per replica {r['requests_per_replica']}")
    return runs


if __name__ == "__main__":
    sys.exit(main())
