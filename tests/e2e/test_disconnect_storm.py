"""A disconnect storm: 100 clients hang up at random points (before admission, during prefill,
during decode, between SSE events, mid-event). Afterwards no slot or mailbox is in use, and the
engine's step records (``--step-log``, ``engine.steplog``) show that no request sampled a token
in a step after the one that found it cancelled."""
from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile

from tests.support.http import get
from tests.support.servers import running_server

CLIENTS = 100  # 20 at each point: every kind of hang-up, cancelled waiting and running
CONCURRENCY = 12  # more than the slots, fewer than slots + queue: many wait in the engine's queue
POINTS = ("before_admission", "during_prefill", "during_decode", "between_events", "mid_event")


def _body(point: str, rng: random.Random) -> bytes:
    # A long prompt (about 400 tokens: a prefill step of its own) gives the prefill time to be interrupted.
    words = 400 if point == "during_prefill" else 20
    content = " ".join(rng.choice(["sea", "cat", "moon", "river", "stone"]) for _ in range(words))
    stream = point in ("between_events", "mid_event") or rng.random() < 0.5
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 64,
                       "ignore_eos": True, "stream": stream, "temperature": 0.7, "seed": rng.randrange(1000)}).encode()


async def _client(port: int, i: int, gate: asyncio.Semaphore, outcomes: dict) -> None:
    rng = random.Random(i)
    point = POINTS[i % len(POINTS)]
    body = _body(point, rng)
    async with gate:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: storm\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        try:
            if point == "before_admission":
                await asyncio.sleep(rng.uniform(0, 0.01))
            elif point == "during_prefill":
                await asyncio.sleep(rng.uniform(0.01, 0.3))
            elif point == "during_decode":
                await asyncio.sleep(rng.uniform(0.3, 2.0))
            else:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
                if b" 200 " in head.split(b"\r\n")[0] and b"event-stream" in head:
                    for _ in range(rng.randrange(1, 12)):
                        await asyncio.wait_for(reader.readuntil(b"\n\n"), 60)  # whole SSE events
                    if point == "mid_event":
                        await asyncio.wait_for(reader.readexactly(rng.randrange(1, 20)), 60)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.transport.abort() if i % 2 else writer.close()  # a reset or a FIN
        outcomes[point] = outcomes.get(point, 0) + 1


async def _storm(port: int) -> dict:
    gate = asyncio.Semaphore(CONCURRENCY)
    outcomes: dict = {}
    await asyncio.gather(*(_client(port, i, gate, outcomes) for i in range(CLIENTS)))
    return outcomes


def test_disconnect_storm_leaves_nothing_and_no_token_after_a_cancel():
    steps_path = tempfile.NamedTemporaryFile(prefix="steps-", suffix=".jsonl", delete=False).name
    try:
        with running_server("--workers", "2", "--max-slots", "4", "--max-queued", "16", "--max-seq-len", "1024",
                            "--step-log", steps_path) as server:
            outcomes = asyncio.run(_storm(server.port))
            server.wait_idle(60)
            assert server.engine.mailboxes_in_use() == 0
            assert server.engine.slot_mailboxes() == [-1] * server.engine.max_slots
            with open(steps_path) as f:
                steps = [json.loads(line) for line in f]
            # the server still serves
            assert get(server, "/health").status == 200
        assert sum(outcomes.values()) == CLIENTS
        cancelled_at = {}
        for s in steps:
            for mailbox, lease in s["cancelled"]:
                assert (mailbox, lease) not in cancelled_at, "cancelled twice"
                cancelled_at[(mailbox, lease)] = s["step"]
        late = [(s["step"], tuple(x)) for s in steps for x in s["sampled"]
                if tuple(x) in cancelled_at and s["step"] > cancelled_at[tuple(x)]]
        assert late == [], late[:5]
        # the storm reached the engine: requests were cancelled while waiting and while running
        sampled = {tuple(x) for s in steps for x in s["sampled"]}
        assert len(cancelled_at) >= CLIENTS // 4, len(cancelled_at)
        assert any(k in sampled for k in cancelled_at) and any(k not in sampled for k in cancelled_at)
    finally:
        os.unlink(steps_path)
