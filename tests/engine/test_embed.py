"""The embedding engine (engine/embed_core.py, engine/llama/embedding.py): whole inputs batched into
one decode a step, each pooled into a unit vector published through its mailbox; the same vector
alone or in a batch, and as llama-cpp-python's own ``Llama.embed`` computes it; more inputs than
slots answered over several steps; cancels, deadlines and requests it does not serve finished as
the generation engine finishes them; a model without pooling, or whose vectors do not fit a
mailbox row, refused at start in one line.

Most tests step an :class:`EmbedCore` by hand over a real transport (each step is then exactly
known); one runs a real engine process."""
from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest

from engine.client import EngineClient
from engine.config import EMBED_DEFAULTS, ConfigError, EngineConfig
from engine.errors import ClientDisconnected, DeadlineExceeded, InvalidRequest, PromptTooLong
from engine.request import EngineRequest, Priority, RequestKind, SamplingParams
from engine.stream import embeddings
from shm import EngineState, ErrorCode, Finish
from shm.transport import Transport
from tests.support.servers import assert_idle_and_clean, running_engine, suite_threads

#: SmolLM2-135M's hidden size, the vectors' dimension.
N_EMBD = 576
#: A SmolLM2 embedding engine: its vectors fit a mailbox row of 640 floats; the file's own weights,
#: as llama-cpp-python computes with them.
SMOL = {"max_seq_len": 640, "n_batch": 640, "max_slots": 24, "max_queued": 40, "pooling": "mean", "weights": "file"}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "Embeddings map text to vectors.", "What is two plus two?"]


def mixed_inputs(n: int) -> list[list[int]]:
    """``n`` inputs of 1 to 54 tokens, no two alike (518 tokens in all for 20)."""
    return [[(1000 + 37 * i + 11 * k) % 40000 + 100 for k in range(1 + (i * 13) % 58)] for i in range(n)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a.astype(np.float64) @ b.astype(np.float64) / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def smol():
    """One SmolLM2 embedding context (mean pooling) for the stepped engines of this module."""
    from engine.llama.embedding import EmbeddingModel
    model = EmbeddingModel.from_config(suite_threads(EngineConfig.embedding(**SMOL)))
    yield model
    model.close()


@contextlib.contextmanager
def stepped(model, **overrides):
    """``(client, core)``: an :class:`EmbedCore` of ``model`` over a new transport, ready, which
    the test steps itself (``core.step()``)."""
    from engine.embed_core import EmbedCore

    config = suite_threads(EngineConfig.embedding(**{**SMOL, **overrides}))
    transport = Transport.create(config.layout())
    core = EmbedCore(config, transport, model)
    transport.control.set_state(EngineState.READY, pid=os.getpid())
    client = EngineClient(transport)
    try:
        yield client, core
    finally:
        core.shutdown(ErrorCode.SHUTDOWN)
        transport.close()


def embed_alone(client, core, ids) -> np.ndarray:
    stream = client.embed(ids)
    core.step()
    return stream.embedding()


# -- configuration and requests ---------------------------------------------------------------------
def test_embed_configuration_is_checked_and_leaves_the_generation_defaults_alone():
    plain = EngineConfig(model_path="m.gguf")
    assert (plain.kind, plain.pooling, plain.max_seq_len, plain.n_batch, plain.max_slots) == \
        ("generate", "", 8192, 512, 16)
    embed = EngineConfig.embedding(model_path="m.gguf")
    assert embed.kind == "embed" and all(getattr(embed, k) == v for k, v in EMBED_DEFAULTS.items())
    assert embed.cache_streams == 0 and embed.layout().embed and not plain.layout().embed
    assert EngineConfig.embedding(model_path="m.gguf", max_slots=4).max_slots == 4
    for kwargs, name in (({"kind": "rerank"}, "kind"), ({"kind": "embed", "pooling": "max"}, "pooling"),
                         ({"pooling": "mean"}, "pooling")):
        with pytest.raises(ConfigError) as e:
            EngineConfig(model_path="m.gguf", **kwargs)
        assert str(e.value).startswith(name) and "\n" not in str(e.value)
    # an input longer than a step's n_batch decodes alone: the micro-batch holds max_seq_len
    assert EngineConfig.embedding(model_path="m.gguf", max_seq_len=2048).n_batch == EMBED_DEFAULTS["n_batch"]


def test_an_embedding_request_generates_nothing_and_may_fill_the_sequence():
    def embed(n, max_new=0):
        return EngineRequest(np.arange(1, n + 1, dtype=np.int32), SamplingParams(max_new_tokens=max_new),
                             kind=RequestKind.EMBED)

    assert embed(16).resolved(16, 0).sampling.max_new_tokens == 0
    assert embed(3, None).resolved(16, 0).sampling.max_new_tokens == 0
    with pytest.raises(InvalidRequest) as e:
        embed(3, 1).resolved(16, 0)
    assert e.value.param == "max_tokens"
    with pytest.raises(PromptTooLong) as e:
        embed(17).resolved(16, 0)
    assert str(e.value) == "input has 17 tokens, more than the limit of 16"
    with pytest.raises(InvalidRequest):  # a generation still needs a token of room, and one to generate
        EngineRequest(np.arange(1, 17, dtype=np.int32), SamplingParams(max_new_tokens=None)).resolved(16, 0)


def test_a_vector_is_published_in_the_mailbox_row_data_then_counter():
    config = EngineConfig.embedding(model_path="m.gguf", max_seq_len=32, n_batch=32, max_slots=1, max_queued=0)
    with Transport.create(config.layout()) as t:
        box = t.mailboxes
        assert t.layout.embed and box.top_ids.shape == (1, 32, 0)
        lease = box.lease()
        vector = np.linspace(-1, 1, 24, dtype=np.float32)
        box.publish_vector(lease.index, vector, time.monotonic())
        assert box.read_new(lease) == (24, False)
        np.testing.assert_array_equal(box.vector(lease), vector)
        with pytest.raises(ValueError):
            box.publish_vector(lease.index, np.zeros(33, np.float32), time.monotonic())
        attached = Transport.attach(t.name)
        assert attached.layout == t.layout
        attached.close()


# -- the stepped engine -------------------------------------------------------------------------------
def test_unit_vectors_the_same_alone_and_in_a_batch_of_20(smol):
    inputs = mixed_inputs(20)
    with stepped(smol) as (client, core):
        assert client.kind == "embed" and client.n_embd == N_EMBD
        streams = [client.embed(ids) for ids in inputs]
        core.step()  # all 20 in one decode: 24 slots, 518 of 640 tokens
        batched = embeddings(streams)
        assert len({s.timings().step_admitted for s in streams}) == 1
        assert all(s.finish_reason == "stop" for s in streams)
        for v in batched:
            assert v.shape == (N_EMBD,) and v.dtype == np.float32
            assert abs(float(np.linalg.norm(v)) - 1) < 1e-5
        for i in (0, 7, 12):  # 1, 34 and 41 tokens
            assert cosine(embed_alone(client, core, inputs[i]), batched[i]) >= 0.9999
        assert cosine(batched[1], batched[2]) < 0.999  # different inputs, different vectors
        # two rare tokens beside 62 others: with llama.cpp's flash attention on a shared cache
        # the vector moved to a cosine of 0.25 (engine/llama/embedding.py)
        short = [130, 230]
        streams = [client.embed(short), client.embed([5] * 62)]
        core.step()
        assert cosine(embed_alone(client, core, short), embeddings(streams)[0]) >= 0.9999
        snap = client.snapshot()
        assert client.mailboxes_in_use() == 0 and snap.n_waiting == 0 and snap.step == core.step_no
        assert snap.slot_mailbox == snap.kv_pos_max == [-1] * 24


def test_more_inputs_than_slots_are_all_answered_over_several_decodes_by_priority_then_arrival(smol):
    inputs = mixed_inputs(10)
    with stepped(smol, max_slots=4) as (client, core):
        streams = [client.embed(ids) for ids in inputs]
        late_high = client.embed([500, 501, 502], priority=Priority.HIGH)
        for _ in range(3):
            core.step()
        vectors = embeddings(streams + [late_high])
        steps = [s.timings().step_admitted for s in streams]
        assert sorted(steps) == steps and len(set(steps)) == 3  # arrival order: 3 (beside the high one), 4, 3
        assert late_high.timings().step_admitted == steps[0] == core.step_no - 2
        assert steps.count(steps[0]) == 3 and steps.count(steps[-1]) == 3
        assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in vectors)
        # an input that does not fit the tokens left lets a smaller one after it in, and leads the next
        # step (a whole sequence of max_seq_len tokens: the batch's n_batch)
        first, big, small = client.embed([7] * 100), client.embed([8] * 640), client.embed([9] * 50)
        core.step()
        core.step()
        embeddings([first, big, small])
        step = first.timings().step_admitted
        assert (small.timings().step_admitted, big.timings().step_admitted) == (step, step + 1)
    # a step packs n_batch tokens; an input longer than that (up to max_seq_len) decodes alone
    with stepped(smol, max_slots=4, n_batch=256) as (client, core):
        first, big, small = client.embed([7] * 100), client.embed([8] * 300), client.embed([9] * 50)
        core.step()
        core.step()
        vectors = embeddings([first, big, small])
        step = first.timings().step_admitted
        assert (small.timings().step_admitted, big.timings().step_admitted) == (step, step + 1)
        assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in vectors)


def test_tenants_take_turns_by_weight_within_a_step(smol):
    """Fair share (engine/fair_share.py): a tenant that queued many inputs first does not fill
    the step; a second tenant of weight 3 gets three inputs of four, tokens over weight being
    equal; a later step serves what is left."""
    with stepped(smol, max_slots=4) as (client, core):
        flood = [client.embed([300 + i] * 10, tenant=1, weight=1.0) for i in range(8)]
        light = [client.embed([400 + i] * 10, tenant=2, weight=3.0) for i in range(4)]
        core.step()
        first = core.step_no
        core.step()
        core.step()
        embeddings(flood + light)
        by_step = lambda streams: [s.timings().step_admitted for s in streams]  # noqa: E731
        assert by_step(light) == [first, first, first, first + 1], by_step(light)
        assert by_step(flood)[:2] == [first, first + 1], by_step(flood)


def test_a_tenant_served_alone_takes_turns_with_a_newcomer_that_floods(smol):
    """A tenant embeds alone, then a second one floods: the flood starts at the first tenant's
    counter (the tenant served last), so the first tenant's next input goes in the flood's first
    step, not after all of it."""
    with stepped(smol, max_slots=4) as (client, core):
        alone = [client.embed([300 + i] * 50, tenant=1) for i in range(4)]
        core.step()
        embeddings(alone)
        flood = [client.embed([400 + i] * 10, tenant=2) for i in range(8)]
        late = client.embed([500] * 10, tenant=1)
        core.step()
        first = core.step_no
        core.step()
        core.step()
        embeddings(flood + [late])
        assert late.timings().step_admitted == first


def test_cancelled_and_expired_waiting_inputs_finish_so(smol):
    with stepped(smol) as (client, core):
        kept, cancelled = client.embed([11, 12, 13]), client.embed([14, 15])
        late = client.embed([16, 17], deadline_ms=1)
        cancelled.cancel()
        time.sleep(0.01)
        core.step()
        assert client.t.mailboxes.outcome(cancelled.lease).finish == Finish.CANCELLED
        assert client.t.mailboxes.outcome(late.lease).finish == Finish.DEADLINE
        with pytest.raises(ClientDisconnected):
            cancelled.embedding()
        with pytest.raises(DeadlineExceeded):
            late.embedding()
        assert cancelled.timings().admitted == 0.0
        assert kept.embedding().shape == (N_EMBD,)
        assert client.mailboxes_in_use() == 0 and client.snapshot().n_waiting == 0


def test_requests_an_embedding_engine_does_not_serve_are_refused(smol):
    with stepped(smol) as (client, core):
        with pytest.raises(InvalidRequest) as e:
            client.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
        assert e.value.param == "model"
        generate = EngineRequest(np.array([1, 2, 3], np.int32), SamplingParams(max_new_tokens=4))
        outside = EngineRequest(np.array([1, 10**6], np.int32), SamplingParams(max_new_tokens=0),
                                kind=RequestKind.EMBED)
        streams = [client.submit(generate), client.submit(outside)]  # past prepare: the engine's own check
        core.step()
        for stream in streams:
            with pytest.raises(InvalidRequest, match="engine rejected"):
                list(stream)
            assert client.t.mailboxes.outcome(stream.lease).error == ErrorCode.BAD_REQUEST
        with pytest.raises(PromptTooLong):
            client.embed(list(range(1, 642)))


def test_a_generation_engine_refuses_an_embedding(model_path):
    from engine.core import EngineCore
    from engine.llama.model import Model

    config = suite_threads(EngineConfig(max_slots=1, max_seq_len=64, prefix_cache_tokens=0, max_queued=1))
    model = Model.from_config(config)
    transport = Transport.create(config.layout())
    try:
        core = EngineCore(config, transport, model)
        transport.control.set_state(EngineState.READY, pid=os.getpid())
        client = EngineClient(transport)
        assert client.kind == "generate" and client.n_embd == 0
        with pytest.raises(InvalidRequest) as e:
            client.embed([1, 2, 3])
        assert e.value.param == "model"
        stream = client.submit(EngineRequest(np.array([1, 2], np.int32), SamplingParams(max_new_tokens=0),
                                             kind=RequestKind.EMBED))
        core.step()
        with pytest.raises(InvalidRequest, match="engine rejected"):
            list(stream)
        core.shutdown(ErrorCode.SHUTDOWN)
    finally:
        transport.close()
        model.close()


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_cls_and_last_pooling_pool_their_own_token_of_each_input(pooling):
    """A causal LM's first token sees only itself: with ``cls`` two inputs that start alike pool to
    the same vector, in one batch; with ``last`` they differ, and an input's vector is its own
    whatever shares its batch."""
    from engine.llama.embedding import EmbeddingModel

    model = EmbeddingModel.from_config(suite_threads(EngineConfig.embedding(**{**SMOL, "pooling": pooling})))
    try:
        a, b = [300, 301, 302, 303], [300, 401, 402]
        with stepped(model, pooling=pooling) as (client, core):
            streams = [client.embed(a), client.embed(b), client.embed([500] * 30)]
            core.step()
            va, vb, _ = embeddings(streams)
            alone = embed_alone(client, core, b)
        assert (cosine(va, vb) > 0.99999) == (pooling == "cls")
        assert cosine(alone, vb) >= 0.9999
    finally:
        model.close()


def test_mean_pooling_agrees_with_llama_cpp_python(smol, model_path):
    """llama-cpp-python's ``Llama.embed`` (mean pooling, normalized) on the same tokens: llama-server
    tokenizes an embedding's input with ``add_special`` and ``parse_special`` (tools/server,
    ``tokenize_input_prompts(..., true, true)``), ``Llama.embed`` with ``add_bos`` (the same
    ``add_special``) and no special parsing: the same ids for plain text."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                          n_threads=1, n_threads_batch=1, verbose=False)
    try:
        with stepped(smol) as (client, core):
            for text in TEXTS:
                ids = llm.tokenize(text.encode(), add_bos=True, special=True)
                assert ids == llm.tokenize(text.encode(), add_bos=True, special=False)
                theirs = np.asarray(llm.embed(text), np.float32)
                ours = embed_alone(client, core, ids)
                assert cosine(ours, theirs / np.linalg.norm(theirs)) >= 0.999, text
    finally:
        llm.close()


def test_a_llama_model_embeds_as_llama_embed_from_a_copy_made_once_and_gemma_as_it_is(tmp_path, model_path,
                                                                                       gemma_model_path):
    """An embedding engine loads a llama-architecture GGUF as llama.cpp's ``llama-embed`` (its
    graph without the language-model head: engine/llama/embedding.py), from a copy written once
    into the weights cache with the same tensors and every ``llama.*`` key renamed; Gemma 3 has no
    such twin and loads as it is. That the twin's vectors are the model's own is
    test_mean_pooling_agrees_with_llama_cpp_python's check (llama-cpp-python loads the file's
    own architecture)."""
    from engine.llama.embedding import embedding_weights_path
    from engine.llama.library import metadata_value

    copy = embedding_weights_path(model_path, str(tmp_path))
    assert os.path.dirname(copy) == str(tmp_path) and copy.endswith(".embed.gguf")
    assert metadata_value(copy, "general.architecture") == "llama-embed"
    for key in ("block_count", "embedding_length", "attention.head_count_kv", "rope.freq_base"):
        assert metadata_value(copy, f"llama-embed.{key}") == metadata_value(model_path, f"llama.{key}") is not None
        assert metadata_value(copy, f"llama.{key}") is None
    assert metadata_value(copy, "tokenizer.ggml.model") == metadata_value(model_path, "tokenizer.ggml.model")
    assert abs(os.path.getsize(copy) - os.path.getsize(model_path)) < 4096  # the same tensors
    written = os.stat(copy).st_mtime_ns
    assert embedding_weights_path(model_path, str(tmp_path)) == copy and os.stat(copy).st_mtime_ns == written
    assert embedding_weights_path(gemma_model_path, str(tmp_path)) == gemma_model_path


def test_gemma_3_sliding_window_model_embeds_about_the_same_alone_and_in_a_batch(gemma_model_path):
    """Gemma 3 270M (interleaved sliding-window layers, 640 dimensions) in the unified cache: its
    vectors the same alone and batched (0.9975 at worst over 20 inputs with flash attention,
    0.9996 without, which the embedding context uses: engine/llama/embedding.py)."""
    from engine.llama.embedding import EmbeddingModel

    config = suite_threads(EngineConfig.embedding(**{**SMOL, "model_path": gemma_model_path, "max_slots": 4}))
    model = EmbeddingModel.from_config(config)
    try:
        assert model.n_embd == 640
        inputs = mixed_inputs(4)
        with stepped(model, model_path=gemma_model_path, max_slots=4) as (client, core):
            streams = [client.embed(ids) for ids in inputs]
            core.step()
            batched = embeddings(streams)
            assert len({s.timings().step_admitted for s in streams}) == 1
            assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in batched)
            assert cosine(embed_alone(client, core, inputs[3]), batched[3]) >= 0.999
    finally:
        model.close()


# -- start-up -----------------------------------------------------------------------------------------
def test_vectors_longer_than_a_mailbox_row_refuse_the_engine(model_path):
    from engine.inproc import InprocEngine

    config = EngineConfig.embedding(max_seq_len=512, n_batch=512, pooling="mean", weights="file")
    with pytest.raises(ConfigError) as e:
        InprocEngine(suite_threads(config))
    assert "576 dimensions, more than max_seq_len (512)" in str(e.value) and "at least 576" in str(e.value)


def test_a_model_without_pooling_fails_start_up_in_one_line(model_path, capfd):
    from engine.supervisor import EngineSupervisor

    config = suite_threads(EngineConfig.embedding(max_seq_len=640, n_batch=640, max_slots=2, max_queued=0))
    supervisor = EngineSupervisor.create(config)
    try:
        supervisor.start()
        assert not supervisor.wait_ready(60)
        assert supervisor.failed and supervisor.restarts == 0
    finally:
        supervisor.stop()
    err = capfd.readouterr().err
    said = [line.split(" engine ERROR ", 1)[1] for line in err.splitlines() if " engine ERROR " in line]
    assert said == [f"the engine cannot start: the model {model_path} declares no pooling for embeddings: "
                    "set pooling (mean, cls or last)"], err
    assert "Traceback" not in err


def test_an_embedding_engine_process_answers_more_inputs_than_slots():
    """The engine process of kind embed (engine/process.py): its dimension in the control block,
    twelve inputs through four slots, all answered, nothing left held."""
    inputs = mixed_inputs(12)
    with running_engine(kind="embed", max_seq_len=640, n_batch=640, max_slots=4, max_queued=16, pooling="mean",
                        weights="file", prefix_cache_tokens=0, max_request_extras_bytes=0) as (client, _):
        assert client.kind == "embed" and client.n_embd == N_EMBD
        streams = [client.embed(ids) for ids in inputs]
        vectors = embeddings(streams)
        assert all(v.shape == (N_EMBD,) and abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in vectors)
        assert len({s.timings().step_admitted for s in streams}) >= 3  # four slots: at least three decodes
        assert_idle_and_clean(client)
