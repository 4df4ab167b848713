"""Helpers shared by the benchmarks: a private engine, the ceiling in a child process."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.supervisor import EngineSupervisor
from shm import Layout, Transport


@contextlib.contextmanager
def engine(config: EngineConfig):
    """Yield an :class:`EngineClient` over a fresh transport and engine process."""
    transport = Transport.create(Layout(config.max_slots, config.n_mailboxes, config.max_seq_len))
    supervisor = EngineSupervisor(config, transport)
    try:
        supervisor.start()
        if not supervisor.wait_ready(120):
            raise RuntimeError("engine did not start")
        yield EngineClient(transport)
    finally:
        supervisor.stop()
        transport.close()


def limit(batch: int, prompt: int, gen: int, threads: int = 0) -> dict:
    """Run ``python -m bench.limit`` in a child process (its own llama.cpp) and return its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "bench.limit", "--batch", str(batch), "--prompt-tokens",
                        str(prompt), "--gen-tokens", str(gen), "--threads", str(threads), "--json", f.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))
