"""KV cache memory by use (engine/llama/kv_pages.py): a real llama.cpp context whose streams of
8,192 cells cost memory only for the cells written, and nothing once freed."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.llama.batch import Batch
from engine.llama.kv_pages import resident_bytes
from engine.llama.model import Model
from tests.support.servers import suite_threads

CELL_BYTES = 30 * 2 * 192 * 2  # SmolLM2-135M: 30 layers, K and V rows of 3 x 64 f16 values
MIB = 1 << 20


@pytest.fixture(scope="module")
def model():
    before = resident_bytes()  # of this test process, which may have run other tests' models
    m = Model.from_config(suite_threads(EngineConfig(max_slots=8, max_seq_len=8192, prefix_cache_tokens=8192)))
    m.started_with = resident_bytes() - before
    yield m
    m.close()


def prefill(model: Model, seq: int, tokens: np.ndarray, pos: int = 0) -> int:
    """Decode ``tokens`` into ``seq`` from position ``pos`` in chunks of 512; returns the greedy
    next token."""
    batch = Batch(512)
    for start in range(0, len(tokens), 512):
        batch.clear()
        batch.add(tokens[start:start + 512], pos + start, seq, True)
        model.decode(batch)
    return int(np.argmax(model.logits(batch.n - 1)))


def greedy(model: Model, seq: int, prompt: np.ndarray, n: int) -> list[int]:
    out, batch = [prefill(model, seq, prompt)], Batch(1)
    for pos in range(len(prompt), len(prompt) + n - 1):
        batch.clear()
        batch.add(np.array(out[-1:], np.int32), pos, seq, True)
        model.decode(batch)
        out.append(int(np.argmax(model.logits(0))))
    return out


def test_streams_cost_the_cells_written_and_nothing_once_freed(model):
    """Ten streams of 8,192 cells are 1.8 GiB of KV buffer; resident is what sequences wrote
    (1,500 cells: 33 MiB)."""
    assert model.pages is not None, "the KV buffer was not found"
    buffer = 10 * 8192 * CELL_BYTES
    tokens = (np.arange(1500, dtype=np.int32) * 7919) % 40000 + 100
    assert model.started_with < buffer / 4  # the model and compute buffers, not the KV buffer
    start = resident_bytes()
    prefill(model, 1, tokens)
    peak = resident_bytes()
    assert 0.9 * 1500 * CELL_BYTES < peak - start < 1500 * CELL_BYTES + 64 * MIB
    model.free_sequence(1)
    # The cells' pages go; the compute buffers' pages the first 512-token decode touched stay.
    assert peak - resident_bytes() > 0.9 * 1500 * CELL_BYTES


def test_given_back_pages_read_as_the_cleared_cells_they_were(model):
    """A stream whose cells were written and given back computes exactly what a stream never
    written does: its decodes read the given-back cells (masked) inside their KV view."""
    prompt = np.arange(300, 420, dtype=np.int32)
    fresh = greedy(model, 6, prompt, 12)
    prefill(model, 5, (np.arange(400, dtype=np.int32) * 31) % 40000 + 100)
    model.free_sequence(5)
    again = greedy(model, 5, prompt, 12)
    model.free_sequence(5)
    model.free_sequence(6)
    assert again == fresh


def test_copies_move_the_cells_used_and_keep_the_output(model):
    """copy_sequence moves only the cells in use (llama.cpp's sequence state), so a copy of a
    short sequence into a stream of 8,192 cells makes little of it resident, and a copied prefix
    continues exactly as the original did (the same chunks computed after it)."""
    prompt = np.arange(500, 700, dtype=np.int32)
    prefill(model, 3, prompt[:150])
    original = prefill(model, 3, prompt[150:], 150)
    before = resident_bytes()
    model.copy_sequence(3, 8)  # into a cache stream
    assert resident_bytes() - before < 200 * CELL_BYTES + 16 * MIB
    model.free_sequence(3)
    model.copy_sequence(8, 4, n_tokens=150)  # a prefix of it into another slot
    model.free_sequence(8)
    assert model.pos_max(4) == 149
    assert prefill(model, 4, prompt[150:], 150) == original
    model.free_sequence(4)


def test_a_sequence_length_llama_cpp_rounds_up_still_gives_its_pages_back():
    """llama.cpp sizes a stream to a multiple of 256 cells (``n_ctx_seq``): at --max-seq-len 128
    each of the 129 streams has 256. The buffer is found at that size, so its 760 MiB are not
    resident (it was found at 128 cells a stream, i.e. not at all, before)."""
    m = Model.from_config(suite_threads(EngineConfig(max_slots=1, max_seq_len=128, prefix_cache_tokens=16384)))
    try:
        assert m.pages is not None, "the KV buffer was not found"
        before = resident_bytes()
        prefill(m, 0, np.arange(100, 228, dtype=np.int32))
        assert resident_bytes() - before < 128 * CELL_BYTES + 16 * MIB
        m.free_sequence(0)
    finally:
        m.close()


def test_the_defaults_serve_the_models_whole_context_beyond_the_old_2048(model_path):
    """--max-seq-len defaults to the bundled model's trained context (8,192), and a 2,400-token
    prompt (smolagents' CodeAgent sends 2,332) is served at the default settings."""
    import llama_cpp

    from engine.request import SamplingParams
    from server.config import from_args
    from tests.support.servers import assert_idle_and_clean, inproc_engine

    config = from_args([], environ={"MODEL_PATH": model_path}).engine_config()
    assert config.max_seq_len == 8192 and config.kv_cache_tokens == 32768
    with inproc_engine(config) as engine:
        assert config.max_seq_len == llama_cpp.llama_model_n_ctx_train(engine.model.model)
        prompt = [int(t) for t in (np.arange(2400) * 7919) % 40000 + 100]
        with engine.client.submit(prompt, SamplingParams(max_new_tokens=2, temperature=0.0,
                                                         ignore_eos=True)) as s:
            assert len([t.id for t in s]) == 2
        assert_idle_and_clean(engine.client)
