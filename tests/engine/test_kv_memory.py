"""KV cache memory by use (engine/llama/kv_pages.py): real llama.cpp contexts whose streams cost
memory only for the cells written, and nothing once freed, on both layouts it knows (SmolLM2's one
cache; Gemma 3's interleaved sliding-window caches); the layouts it does not know refused (a
transposed V; a recurrent model, which the engine then runs on the unified cache and says so)."""
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


# Gemma 3 270M: interleaved sliding-window attention (llama.cpp's llama_kv_cache_iswa). Every sixth
# layer attends to the whole context (3 layers: the base cache), the 15 others to a 512-token
# window (the SWA cache); one KV head of 256 dimensions, f16: a 512-byte row.
GEMMA_BASE_CELL = 3 * 2 * 512
GEMMA_SWA_CELL = 15 * 2 * 512


@pytest.fixture(scope="module")
def gemma(gemma_model_path):
    m = Model.from_config(suite_threads(EngineConfig(model_path=gemma_model_path, max_slots=4, max_seq_len=4096,
                                                     prefix_cache_tokens=4096)))
    yield m
    m.close()


def test_both_caches_of_the_sliding_window_layout_are_found(gemma):
    """The base cache has a stream of 4,096 cells a sequence, the SWA cache the window and a
    micro-batch (512 + 512) a sequence, not 4,096 (llama-server's sizing, swa_full off): 6 streams
    of each, 144 MiB + 90 MiB of buffer, none of it resident."""
    assert gemma.pages is not None, "the KV buffers were not found"
    assert [(c.name, c.kv_size, c.n_stream, len(c.row_bytes), c.cell_bytes) for c in gemma.pages.layouts] == [
        ("base", 4096, 6, 3, GEMMA_BASE_CELL), ("swa", 1024, 6, 15, GEMMA_SWA_CELL)]
    assert gemma.window == 512


def test_a_stream_of_each_cache_costs_what_its_sequence_wrote_and_goes_back(gemma):
    """1,500 tokens write 1,500 base cells and, in the SWA cache, every cell of the stream's ring
    of 1,024 (older positions are overwritten); freeing the sequence gives both back."""
    tokens = (np.arange(1500, dtype=np.int32) * 7919) % 200000 + 1000
    start = resident_bytes()
    prefill(gemma, 2, tokens)
    peak = resident_bytes()
    written = 1500 * GEMMA_BASE_CELL + 1024 * GEMMA_SWA_CELL  # 4.4 + 15 MiB
    assert 0.9 * written < peak - start < written + 64 * MIB  # and the compute buffers a first chunk touches
    assert gemma.pos_min(2) >= 1500 - 1024  # the window cache dropped what no next position sees
    gemma.free_sequence(2)
    assert peak - resident_bytes() > 0.9 * written


def test_a_sliding_window_copy_carries_the_window_and_continues_as_the_original(gemma):
    """A copy of a sequence longer than the window carries its base cells and its last window of
    SWA cells (llama.cpp's sequence state), and decodes on exactly as the original."""
    prompt = (np.arange(900, dtype=np.int32) * 31) % 200000 + 1000
    prefill(gemma, 0, prompt[:800])
    original = prefill(gemma, 0, prompt[800:], 800)
    gemma.free_sequence(0)
    prefill(gemma, 1, prompt[:800])
    before = resident_bytes()
    gemma.copy_sequence(1, 4)  # into a cache stream: 800 base cells, 512 SWA cells
    assert resident_bytes() - before < 800 * GEMMA_BASE_CELL + 512 * GEMMA_SWA_CELL + 16 * MIB
    assert gemma.pos_min(4) == 800 - 512
    gemma.free_sequence(1)
    gemma.copy_sequence(4, 3)
    gemma.free_sequence(4)
    assert prefill(gemma, 3, prompt[800:], 800) == original
    gemma.free_sequence(3)


def test_a_state_whose_v_rows_are_transposed_is_refused(model_path):
    """A state :mod:`engine.llama.kv_pages` does not know is refused, never guessed: a real
    context with flash attention off, whose V is stored transposed (one cell's V is then no row
    of the buffer)."""
    import ctypes

    import llama_cpp

    from engine.llama.kv_pages import LayoutRefused, parse_probe
    from engine.llama.library import load_model

    model = load_model(model_path)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = 512, 2, False
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama_cpp.llama_init_from_model(model, params)
    try:
        batch = Batch(1)
        batch.add(np.array([5], np.int32), 0, 0, False)
        assert llama_cpp.llama_decode(ctx, batch.as_struct()) == 0
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        state = (ctypes.c_uint8 * size)()
        llama_cpp.llama_state_seq_get_data(ctx, state, size, 0)
        with pytest.raises(LayoutRefused, match="transposed"):
            parse_probe(bytes(state))
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def write_tiny_mamba(path: str, n_embd: int = 64, n_layer: int = 2, n_vocab: int = 260) -> None:
    """A GGUF of a Mamba model (llama.cpp's ``mamba`` architecture: a recurrent memory, one state
    per sequence) with random float32 weights and a byte vocabulary: real for llama.cpp, small
    enough to write here (no such model is installable). GGUF v3: header, metadata, tensor
    infos, data aligned to 32 bytes (ggml's GGUF specification)."""
    import struct

    rng = np.random.default_rng(0)
    d_inner, d_state, dt_rank, d_conv = 2 * n_embd, 16, 4, 4
    tokens = ["<unk>", "<s>", "</s>", " "] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3, 1] + [6] * 256

    def string(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    meta = [("general.architecture", 8, "mamba"), ("mamba.context_length", 4, 4096),
            ("mamba.embedding_length", 4, n_embd), ("mamba.block_count", 4, n_layer),
            ("mamba.feed_forward_length", 4, 0), ("mamba.attention.head_count", 4, 0),
            ("mamba.ssm.conv_kernel", 4, d_conv), ("mamba.ssm.inner_size", 4, d_inner),
            ("mamba.ssm.state_size", 4, d_state), ("mamba.ssm.time_step_rank", 4, dt_rank),
            ("mamba.attention.layer_norm_rms_epsilon", 6, 1e-5), ("tokenizer.ggml.model", 8, "llama"),
            ("tokenizer.ggml.tokens", (9, 8), tokens), ("tokenizer.ggml.scores", (9, 6), [0.0] * len(tokens)),
            ("tokenizer.ggml.token_type", (9, 5), types), ("tokenizer.ggml.bos_token_id", 4, 1),
            ("tokenizer.ggml.eos_token_id", 4, 2), ("tokenizer.ggml.unknown_token_id", 4, 0)]
    scalar = {4: "<I", 5: "<i", 6: "<f"}
    kv = b""
    for key, kind, value in meta:
        kv += string(key)
        if isinstance(kind, tuple):
            kv += struct.pack("<IIQ", 9, kind[1], len(value))
            kv += b"".join(string(v) if kind[1] == 8 else struct.pack(scalar[kind[1]], v) for v in value)
        else:
            kv += struct.pack("<I", kind) + (string(value) if kind == 8 else struct.pack(scalar[kind], value))
    shapes = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,)}
    for i in range(n_layer):
        shapes.update({f"blk.{i}.attn_norm.weight": (n_embd,), f"blk.{i}.ssm_in.weight": (n_embd, 2 * d_inner),
                       f"blk.{i}.ssm_conv1d.weight": (d_conv, d_inner), f"blk.{i}.ssm_conv1d.bias": (d_inner,),
                       f"blk.{i}.ssm_x.weight": (d_inner, dt_rank + 2 * d_state),
                       f"blk.{i}.ssm_dt.weight": (dt_rank, d_inner), f"blk.{i}.ssm_dt.bias": (d_inner,),
                       f"blk.{i}.ssm_a": (d_state, d_inner), f"blk.{i}.ssm_d": (d_inner,),
                       f"blk.{i}.ssm_out.weight": (d_inner, n_embd)})
    infos, data = b"", b""
    for name, shape in shapes.items():
        values = (rng.standard_normal(int(np.prod(shape))) * 0.1).astype(np.float32)
        if name.endswith(("norm.weight",)):
            values[:] = 1.0
        if name.endswith("ssm_a"):
            values = -np.abs(values) - 0.5  # A = -exp(A_log) < 0
        infos += string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        infos += struct.pack("<IQ", 0, len(data))  # F32, offset
        data += values.tobytes() + b"\0" * (-len(values.tobytes()) % 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(shapes), len(meta)) + kv + infos
    with open(path, "wb") as f:
        f.write(head + b"\0" * (-len(head) % 32) + data)


def test_a_recurrent_memory_is_refused_said_and_bounded(tmp_path, caplog):
    """A model whose memory kv_pages does not know (here a recurrent one: a state per sequence,
    no KV cells) is not searched for pages: the engine logs one WARNING line with the reason and
    the megabytes it holds, and runs on llama.cpp's unified cache of the budgets' cells. Its
    prefix cache reuses only whole sequences (window 0: a state is its last position's)."""
    import logging

    path = str(tmp_path / "tiny-mamba.gguf")
    write_tiny_mamba(path)
    config = EngineConfig(model_path=path, max_slots=2, max_seq_len=256, kv_cache_tokens=512, prefix_cache_tokens=512,
                          n_batch=64)
    with caplog.at_level(logging.WARNING, logger="engine"):
        m = Model.from_config(suite_threads(config))
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "recurrent" in warnings[0] and "MB resident" in warnings[0], warnings
        assert m.pages is None and m.window == 0 and m.params.kv_unified and m.params.n_ctx == 1280
        first = greedy(m, 0, np.arange(10, 40, dtype=np.int32), 4)
        m.copy_sequence(0, 1)
        m.free_sequence(0)
        assert len(first) == 4 and m.pos_max(1) == 32
    finally:
        m.close()


def test_logits_rows_are_32_mib_within_the_batch_and_one_a_sequence_at_least():
    """The rows a decode may ask for, which llama.cpp allocates twice (output buffer and compute
    graph): 32 MiB of them, no more than a batch, and never fewer than the context's sequences
    (llama.cpp's ``output_reserve`` aborts the process below that)."""
    from engine.llama.model import logits_rows

    assert logits_rows(262_144, 17, 512) == 32  # Gemma 3: 1 MiB a row
    assert logits_rows(49_152, 17, 512) == 170  # SmolLM2
    assert logits_rows(49_152, 17, 64) == 64
    assert logits_rows(262_144, 40, 512) == 40
