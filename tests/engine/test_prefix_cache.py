"""The prefix cache: reused KV cells give the same greedy output (``--deterministic``), exact ``cached_tokens``, reuse
scoped per tenant, bounded memory, and the usual guarantees on disconnects, deadlines and engine
restarts. Real model, real engine (in-process or its own process), real app."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.prefix_cache import MIN_REUSE_TOKENS
from engine.llama.backend import CPU_DETERMINISTIC
from engine.inproc import InprocEngine
from engine.request import SamplingParams
from tests.support.servers import (AppServer, assert_idle_and_clean, inproc_engine, kill_engine_mid_stream,
                                   running_engine, wait_steps)

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
# Long enough (about 300 tokens with the template) that contexts pass 256 cells, where llama.cpp's
# attention changes kernels for a lone sequence (engine.llama.backend: split_kv_after_tokens), and
# past 64 tokens, where it changes kernels for a prompt chunk: the identity they test is the
# deterministic profile's promise (the default profile makes none past those bounds).
SYSTEM = ("You are the support assistant of the Northwind Trading Company. Answer in one short sentence, "
          "politely, and never invent order numbers. Our shop sells tea, coffee, spices and dried fruit; "
          "shipping takes three to five working days and returns are accepted within thirty days. ") * 5
QUESTIONS = ["Do you sell green tea?", "How long does shipping take?", "Can I return opened coffee?",
             "What spices do you have?", "Do you ship abroad?", "Is there a discount for students?",
             "What are your opening hours?", "Do you sell dried mango?"]


def _prompts(chat, n: int) -> list[list[int]]:
    return [chat.encode([{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {i})"}])
            for i in range(n)]


def _run_all(engine: InprocEngine, prompts, params=GREEDY):
    """Submit every prompt at once; ``[(token ids, n_cached, step admitted)]`` in prompt order."""
    streams = [engine.client.submit(p, params) for p in prompts]
    out = []
    for s in streams:
        ids = [t.id for t in s]
        out.append((ids, s.n_cached, s.timings().step_admitted))
    return out


def _config(model_path, **kw) -> EngineConfig:
    return EngineConfig(**{"model_path": model_path, "max_slots": 8, "max_seq_len": 1024, "max_queued": 32, **kw})


def test_shared_prefix_outputs_equal_cache_off_and_cached_tokens_exact(model_path, chat):
    prompts = _prompts(chat, 6)  # more than the 4 slots: some wait for a free one as well
    shared = len(chat.encode([{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    with inproc_engine(_config(model_path, max_slots=4, prefix_cache_tokens=0, deterministic=True)) as off_engine:
        off = _run_all(off_engine, prompts)
    with inproc_engine(_config(model_path, max_slots=4, deterministic=True)) as on_engine:
        on = _run_all(on_engine, prompts)
        assert_idle_and_clean(on_engine.client)
    assert [ids for ids, _, _ in on] == [ids for ids, _, _ in off]
    assert all(n == 0 for _, n, _ in off)
    # The shared prefix is prefilled once: the first prompt is admitted alone, the others wait
    # until its cells hold all but less than a chunk of the prefix (PrefixCache.awaits),
    # then reuse what it holds.
    first = min(step for _, _, step in on)
    assert [step for _, _, step in on].count(first) == 1
    for ids, n_cached, step in on:
        assert len(ids) > 0
        if step == first:
            assert n_cached == 0
        else:
            assert shared - CPU_DETERMINISTIC.max_chunk_tokens < n_cached < len(prompts[0]), (n_cached, step)


def _conversation(app) -> list[tuple[str, dict]]:
    """Four turns, each sent with the whole conversation so far: ``[(reply, usage)]``."""
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for question in ["Do you sell green tea?", "Which one do you recommend?", "How much does it cost?",
                     "Thanks, can I order two?"]:
        messages.append({"role": "user", "content": question})
        status, _, raw = app.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": messages, "max_tokens": 16, "temperature": 0}).encode(),
            {"Content-Type": "application/json"})
        assert status == 200, raw
        body = json.loads(raw)
        reply = body["choices"][0]["message"]["content"]
        out.append((reply, body["usage"]))
        messages.append({"role": "assistant", "content": reply})
    app.wait_idle()
    return out


def test_four_turn_conversation_reuses_every_previous_turn(app, model_path, tokenizer, chat):
    """On the deterministic ``app`` (and an engine like it without the cache): the same replies."""
    from server.generation.pipeline import Generator

    turns = _conversation(app)
    for k, (_, usage) in enumerate(turns):
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached < usage["prompt_tokens"]
        if k:
            # The previous prompt and reply are resident, but for the reply's last token: a
            # reply cut by max_tokens ends on a token that was sampled and never fed (and
            # one that stopped never fed its <|im_end|>, which the template adds here).
            previous = turns[k - 1][1]
            assert cached >= previous["prompt_tokens"] + previous["completion_tokens"] - 1, (k, usage, previous)
    assert turns[-1][1]["prompt_tokens"] > 300  # past the 256 cells where the kernels change
    with inproc_engine(dataclasses.replace(app.config.engine_config(), prefix_cache_tokens=0)) as engine:
        off = _conversation(AppServer(app.config, Generator(engine.client, tokenizer, chat)))
    assert [reply for reply, _ in turns] == [reply for reply, _ in off]
    assert all(usage["prompt_tokens_details"]["cached_tokens"] == 0 for _, usage in off)


def test_streamed_usage_and_infer_report_cached_tokens(app):
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}],
            "max_tokens": 4, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    assert app.request("POST", "/v1/chat/completions", json.dumps(body).encode(), headers)[0] == 200
    status, _, raw = app.request("POST", "/v1/chat/completions", json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}).encode(), headers)
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    status, _, raw = app.request("POST", "/infer", json.dumps({"payload": "Hello there", "max_new_tokens": 3}).encode(),
                                 headers)
    first = json.loads(raw)
    status, _, raw = app.request("POST", "/infer", json.dumps({"payload": "Hello there", "max_new_tokens": 3}).encode(),
                                 headers)
    second = json.loads(raw)
    assert status == 200 and second["cached_tokens"] > 0 and second["text"] == first["text"]
    app.wait_idle()


def test_cache_is_scoped_per_tenant(tmp_path, model_path, tokenizer, chat):
    from server.config import ServerConfig
    from server.generation.pipeline import Generator
    from server.tenancy.tenants import Tenants, TenantRegistry

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"id": "alpha", "api_keys": ["alpha-key"]},
                                            {"id": "beta", "api_keys": ["beta-key"]}]}))
    # --deterministic: beta's second answer comes from the cache (past 64 tokens) in both servers.
    config = ServerConfig(model_path=model_path, max_slots=4, max_seq_len=512, tenants_file=str(path),
                          deterministic=True)
    canary = "Zanzibar-Quokka-7731"

    def ask(key: str, question: str) -> dict:
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                "max_tokens": 24, "temperature": 0}
        status, _, raw = app.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        assert status == 200, raw
        return json.loads(raw)

    with inproc_engine(config.engine_config()) as engine:
        app = AppServer(config, Generator(engine.client, tokenizer, chat), TenantRegistry(Tenants.load(str(path))))
        for i in range(3):
            a = ask("alpha-key", f"Repeat the code word {canary} back to me, ticket {i}.")
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # alpha reuses its own
        beta = [ask("beta-key", q) for q in ("Repeat the code word back to me.", "What was the code word?")]
        assert beta[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert beta[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # from beta's first
        assert all(canary.split("-")[0] not in b["choices"][0]["message"]["content"] for b in beta)
        app.wait_idle()
    # Beta's answers are what beta gets from a server that never saw alpha.
    with inproc_engine(config.engine_config()) as engine:
        app = AppServer(config, Generator(engine.client, tokenizer, chat), TenantRegistry(Tenants.load(str(path))))
        alone = [ask("beta-key", q) for q in ("Repeat the code word back to me.", "What was the code word?")]
    assert [b["choices"][0]["message"]["content"] for b in beta] == \
        [b["choices"][0]["message"]["content"] for b in alone]


def test_eviction_keeps_the_cache_within_its_budget_and_leaks_nothing(model_path, tokenizer):
    budget = 520  # three 256-cell streams, and fewer tokens than three of the longest entries (200)
    config = _config(model_path, max_slots=2, max_seq_len=256, prefix_cache_tokens=budget)
    assert config.cache_streams == 3
    with inproc_engine(config) as engine:
        client = engine.client
        for i in range(12):  # 4 rounds of the 3 lengths: 9 evictions
            # Distinct from the first token on: no entry is ever a prefix of another.
            prompt = tokenizer.encode(f"{i} " + "lorem ipsum dolor sit amet " * (5 + 7 * (i % 3)))  # 52..192 tokens
            with client.submit(prompt, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)) as s:
                list(s)
            wait_steps(client, 2)
            snap = client.snapshot()
            held = [p + 1 for p in snap.cache_kv_pos_max if p >= 0]
            assert snap.cache_tokens <= budget and snap.cache_entries <= 3
            assert len(held) == snap.cache_entries and sum(held) == snap.cache_tokens, snap
        assert snap.cache_entries >= 1
        assert_idle_and_clean(client)


def test_cancel_deadline_and_engine_restart_with_the_cache_on(chat):
    prompts = _prompts(chat, 3)
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    # --deterministic: a 300-token prompt cold and from the cache are compared token for token.
    with running_engine(max_slots=2, max_seq_len=512, max_queued=8, deterministic=True) as (client, supervisor):
        with client.submit(prompts[0], GREEDY) as s:
            expected = [t.id for t in s]
        # A cancelled and a timed-out sequence that both reused the prefix.
        cancelled = client.submit(prompts[0], long)
        next(iter(cancelled))
        cancelled.close()
        timed_out = client.submit(prompts[0], long, deadline_ms=300)
        list(timed_out)
        assert timed_out.finish_reason == "deadline" and timed_out.n_cached >= MIN_REUSE_TOKENS
        assert cancelled.n_cached >= MIN_REUSE_TOKENS
        with client.submit(prompts[0], GREEDY) as s:
            assert [t.id for t in s] == expected and s.n_cached > 0
        assert_idle_and_clean(client)
        # The engine dies under a sequence that reused a prefix; the new engine process starts
        # with an empty cache and gives the same answers.
        kill_engine_mid_stream(client, supervisor, prompts[0], long)
        wait_steps(client, 1, timeout=30)
        assert client.snapshot().cache_entries == 0
        with client.submit(prompts[0], GREEDY) as s:
            assert [t.id for t in s] == expected and s.n_cached == 0
        assert_idle_and_clean(client)


@pytest.mark.parametrize("flags, tokens, streams", [
    ([], 16384, 8),  # entries of CACHE_ENTRY_TOKENS (2,048), not of the 8,192-token max_seq_len
    (["--no-prefix-cache"], 0, 0),
    (["--prefix-cache-tokens", "4096"], 4096, 2),
    (["--prefix-cache-tokens", "4096", "--max-seq-len", "1024"], 4096, 4),
])
def test_prefix_cache_flags(flags, tokens, streams):
    from server.config import from_args
    config = from_args(flags, environ={})
    assert config.prefix_cache_tokens == tokens
    assert config.engine_config().cache_streams == streams


def test_a_prefix_short_against_its_source_is_prefilled_not_copied(model_path):
    """A copy carries every cell its source holds, so a shared prefix under 1/64 of them is
    prefilled instead (COPY_CELLS_PER_REUSED_TOKEN); from that fraction on it is reused."""
    from engine.prefix_cache import COPY_CELLS_PER_REUSED_TOKEN

    source = [(i * 7919) % 40000 + 100 for i in range(764)]  # a cache entry of 764 + 4 cells
    need = (len(source) + 4) // COPY_CELLS_PER_REUSED_TOKEN  # 12 tokens, over MIN_REUSE_TOKENS
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    with inproc_engine(_config(model_path, max_slots=2, max_seq_len=2048)) as engine:
        list(engine.client.submit(source, params))
        for shared, cached in ((need - 4, 0), (need, need)):
            with engine.client.submit(source[:shared] + [50, 51, 52], params) as s:
                list(s)
                assert s.n_cached == cached, shared
        assert_idle_and_clean(engine.client)


def test_a_sliding_window_model_reuses_what_it_keeps_and_prefills_the_rest(gemma_model_path):
    """Gemma 3 attends through a 512-token window in 15 of its 18 layers, and llama.cpp keeps only
    a sequence's last window of those layers' cells: a cached sequence longer than the window can
    give all its cells, never a part (engine.prefix_cache.reusable). A prompt that extends one
    reuses all of it; a prompt that shares only part of one is prefilled whole; a source shorter
    than the window gives any part. Each reply with a hit is the cold run's (another tenant's, which shares
    no cell), under ``--deterministic`` and on Q8_0 weights: the file's Q4_K products are not
    batch-invariant (llama.cpp's repacked K-quant kernels sum a row differently by the rows beside
    it: 2.2 apart in a logit between two chunkings). Sequences stay under the 1,024 cells of a
    stream's window cache: past them llama.cpp's ring puts new cells before older ones, and
    attention sums in cell order."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(7)
    long = [int(t) for t in rng.integers(1000, 200000, 560)]
    short = [int(t) for t in rng.integers(1000, 200000, 300)]
    tail = [int(t) for t in rng.integers(1000, 200000, 24)]
    config = _config(gemma_model_path, max_slots=2, max_seq_len=1024, deterministic=True, weights="q8_0")
    with inproc_engine(config) as engine:
        def run(prompt, tenant):
            with engine.client.submit(prompt, params, tenant=tenant) as s:
                return [t.id for t in s], s.n_cached

        first, cached = run(long, 1)  # kept: the prompt and 5 of the 6 tokens (the last is never fed)
        extended = long + first + tail
        partial = long[:540] + tail
        for prompt, expected in ((extended, len(long) + 5), (partial, 0), (short, 0), (short[:250] + tail, 250)):
            reply, cached = run(prompt, 1)
            assert cached == expected, (len(prompt), cached)
            if cached:  # (prefilled whole, it is a cold run)
                assert reply == run(prompt, 2 + len(prompt))[0]  # a tenant of its own: cold
        assert_idle_and_clean(engine.client)
