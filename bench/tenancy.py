"""Throughput with a tenant file and Redis on, against both off, in one run.

    python -m bench.tenancy [--clients 16 --prompt-tokens 32 --gen-tokens 128 --repeat 3] [--json out.json]

Starts two real servers with the same flags: one plain, one with ``--tenants`` (one tenant whose
request and token buckets are far above what the run can use, so every request goes through the
Redis script without being limited) and ``--redis-url`` (a ``redis-server`` started here).
Runs alternate between the two, the idle one sleeping; the workload is ``bench.http``'s. The
ratio of medians is reported.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile


def main(argv=None) -> int:
    from bench.common import parser, save
    from bench.http import prompt_text, stream_completion, throughput
    from engine.config import default_model_path
    from engine.llama.tokenizer import Tokenizer
    from tests.support.servers import redis_server, running_server

    p = parser("python -m bench.tenancy", __doc__, "--clients")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    B, P, G = a.batch, a.prompt_tokens, a.gen_tokens
    tokenizer = Tokenizer(default_model_path())
    prompts = [prompt_text(tokenizer, P, i) for i in range(B)]
    flags = ["--max-slots", str(B), "--max-seq-len", str(max(256, P + G + 8)), "--threads", str(B + 4),
             "--engine-threads", str(a.engine_threads)]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"tenants": [{"id": "bench", "api_keys": ["bench-key"],
                                "requests_per_second": {"rate": 1e6, "burst": 1e6},
                                "tokens_per_second": {"rate": 1e9, "burst": 1e9}}]}, f)
        f.flush()
        with redis_server() as (url, _), running_server(*flags) as plain, \
                running_server(*flags, "--tenants", f.name, "--redis-url", url) as tenanted:
            stream_completion(plain.port, prompts[0], 4)
            stream_completion(tenanted.port, prompts[0], 4, "bench-key")
            off, on = [], []
            for _ in range(a.repeat):
                off.append(throughput(plain.port, prompts, G)[0])
                plain.wait_idle()
                on.append(throughput(tenanted.port, prompts, G, "bench-key")[0])
                tenanted.wait_idle()
    ratio = statistics.median(on) / statistics.median(off)
    print("off (tok/s): " + ", ".join(f"{x:.1f}" for x in off))
    print("tenants + Redis (tok/s): " + ", ".join(f"{x:.1f}" for x in on))
    print(f"tenants + Redis on / off (medians): {ratio:.3f}")
    save({"off_tokens_per_s": off, "on_tokens_per_s": on, "ratio": ratio}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
