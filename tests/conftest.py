"""The suite's hooks (the order of its files, its engines' compute threads) and its shared
fixtures: the model's tokenizer and chat template, one real server (``server``), one with a
single slot (``single``) and the app over an in-process engine (``app``). The processes behind
them are tests/support/servers.py's."""
from __future__ import annotations

import os

import pytest

from tests.support.model import chat, gemma_model_path, model_path, tokenizer  # noqa: F401 - pytest fixtures
from tests.support.servers import SUITE_ENGINE_THREADS, AppServer, inproc_engine, running_server

# `make test` runs the suite on three pytest-xdist workers, a file to a worker (--dist loadfile,
# --no-loadscope-reorder): the files that take longest go first, so that none of them starts last
# and runs alone. Measured with `--durations=0` under `make test` (seconds a file held its worker).
LONGEST_FIRST = ("test_generated_requests.py", "test_control_plane.py", "test_models.py", "test_engine.py",
                 "test_prefix_cache.py", "test_tenancy.py", "test_structured.py", "test_embed.py",
                 "test_kv_memory.py", "test_resilience.py", "test_http_server.py", "test_second_model.py",
                 "test_tools_clients.py", "test_soak.py", "test_grpc.py", "test_drain.py",
                 "test_openai_conformance.py", "test_responses.py", "test_bench_threads.py",
                 "test_bench_policies.py", "test_bench_tenants.py", "test_admin_page.py", "test_openapi.py",
                 "test_http_contract.py", "test_multinode.py", "test_lm_eval.py", "test_connections.py",
                 "test_metrics.py", "test_disconnect_storm.py")


def pytest_configure(config):
    os.environ.setdefault("ENGINE_THREADS", SUITE_ENGINE_THREADS)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def server():
    """One shared server: 4 slots x 512 tokens, greedy tests run against it."""
    with running_server("--max-slots", "4", "--max-seq-len", "512", "--max-queued", "16",
                        "--workers", "2", "--threads", "16", "--max-body-bytes", "65536") as s:
        yield s


@pytest.fixture(scope="session")
def app(model_path, tokenizer, chat):
    """The shared server's configuration (4 slots x 512 tokens, 64 KiB bodies), in-process.

    It computes with the default weights (the Q8_0 copy, engine/llama/weights.py), whose prefill
    costs this suite's many in-process prompts 15 % less CPU than the file's own Q4_1
    (tests/engine/test_weights.py serves that one). It is ``--deterministic`` (the batch-invariant
    profile, engine/llama/backend.py), so a greedy reply does not depend on what else is batched
    or cached: tests/server/test_http_contract.py asks for a reply once and builds its expectations from
    it, and tests that compare outputs with and without a prefix-cache hit can hold it to that
    promise. No test pins a reply's text: it
    depends on the CPU's kernels (AVX2 and AVX-512 builds part after a few tokens)."""
    from server.config import ServerConfig
    from server.generation.pipeline import Generator

    config = ServerConfig(model_path=model_path, max_slots=4, max_seq_len=512, max_queued=16,
                          max_body_bytes=65536, deterministic=True)
    with inproc_engine(config.engine_config()) as engine:
        yield AppServer(config, Generator(engine.client, tokenizer, chat))
    assert not os.path.exists(f"/dev/shm/{engine.transport.name}"), "segment not unlinked"


@pytest.fixture(scope="module")
def single():
    """One slot and one queue place: two mailboxes in all."""
    with running_server("--max-slots", "1", "--max-queued", "1", "--max-seq-len", "256",
                        "--workers", "1", "--threads", "8") as s:
        yield s
