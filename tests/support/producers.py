"""Functions run in separate producer processes (spawned), attached to the transport by name."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from engine.client import EngineClient
from engine.request import SamplingParams
from server.api.fields import priority


def generate_many(transport_name: str, jobs: list[dict]) -> list[dict]:
    """Submit every job concurrently (one thread each) and return, per job, its token ids,
    finish reason and timings. A job is ``{"prompt": [...], "params": {...}, **submit kwargs}``."""
    client = EngineClient.attach(transport_name)
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            return list(pool.map(lambda job: _run(client, job), jobs))
    finally:
        client.close()


def _run(client: EngineClient, job: dict) -> dict:
    job = dict(job)
    prompt, params = job.pop("prompt"), SamplingParams(**job.pop("params"))
    if "priority" in job:
        job["priority"] = priority(job["priority"])
    with client.submit(prompt, params, **job) as stream:
        ids = [t.id for t in stream]
        return {"ids": ids, "finish": stream.finish_reason, "timings": stream.timings().__dict__}
