"""Engine throughput through shared memory against the ceiling, in one run.

    python -m bench.engine [--batch 16 --prompt-tokens 32 --gen-tokens 128] [--json out.json]

A separate producer process submits B concurrent sequences (the ceiling's prompts, greedy,
EOS ignored) through the request ring and reads every token from its mailbox; generated
tokens/s is B*G over the time from the first submit to the last token. ``bench.limit`` runs
before and after in child processes; the ratio is against their mean.
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def produce(transport_name: str, prompts: list[list[int]], gen: int) -> float:
    """In a producer process: submit all prompts at once, drain all streams; returns seconds."""
    from engine.client import EngineClient, SamplingParams

    client = EngineClient.attach(transport_name)
    params = SamplingParams(max_new_tokens=gen, temperature=0.0, ignore_eos=True)

    def one(prompt):
        with client.submit(prompt, params) as stream:
            n = sum(1 for _ in stream)
        assert n == gen, (n, gen)
        return time.perf_counter()

    with ThreadPoolExecutor(len(prompts)) as pool:
        t0 = time.perf_counter()
        ends = list(pool.map(one, prompts))
    client.close()
    return max(ends) - t0


def main(argv=None) -> int:
    from bench.common import engine, limit, parser, report
    from bench.limit import prompt_tokens
    from engine.config import EngineConfig

    a = parser("python -m bench.engine", __doc__, "--batch").parse_args(argv)
    B, P, G = a.batch, a.prompt_tokens, a.gen_tokens
    before = limit(B, P, G, a.engine_threads)
    config = EngineConfig(max_slots=B, max_seq_len=max(256, P + G + 1), max_queued=0,
                          n_threads=a.engine_threads)
    with engine(config) as client:
        with mp.get_context("spawn").Pool(1) as pool:
            seconds = pool.apply(produce, (client.t.name, prompt_tokens(B, P, 49152), G))
    after = limit(B, P, G, a.engine_threads)
    report("engine via shm", B * G / seconds, before, after, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
