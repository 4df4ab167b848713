"""An embedding context: llama.cpp pooling each sequence of a batch into one vector (low-level API
of llama-cpp-python), as llama-server's ``--embeddings`` does (tools/server/server-context.cpp,
``send_embedding``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from engine.config import ConfigError
from engine.llama.backend import CPU, Backend, detect
from engine.llama.library import metadata_value
from engine.llama.model import Context
from engine.llama.weights import cached_copy, weights_path

if TYPE_CHECKING:
    from engine.config import EngineConfig

#: ``EngineConfig.pooling`` as llama.cpp's ``llama_pooling_type`` (llama.h); ``""`` leaves it to
#: the GGUF (``<arch>.pooling_type``; NONE where it says nothing).
POOLING_TYPES = {"": llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED, "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                 "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
#: Cells of llama.cpp's KV cache come in multiples of this (it pads ``n_ctx`` so).
CTX_PAD = 256
#: llama.cpp architectures whose graph ends in the language-model head, each mapped to the
#: architecture of the same weights and layers whose graph stops at the normed hidden states that
#: pooling reads (llama.cpp's ``src/models/llama-embed.cpp``: ``llama_model_llama::graph<true>``,
#: with the attention over the micro-batch itself instead of a KV cache, causal unless the GGUF's
#: ``<arch>.attention.causal`` says otherwise). Why: an embedding batch's every token is an
#: output, so a causal LM's head would turn each into ``n_vocab`` logits nobody reads: for
#: SmolLM2-135M a fifth of the multiply-adds and a ``n_batch x n_vocab`` copy a step.
EMBEDDING_ARCHITECTURES = {"llama": "llama-embed"}


def embedding_weights_path(path: str, folder: str | None = None) -> str:
    """The GGUF an embedding context loads for ``path``: where its architecture has an
    embedding twin (:data:`EMBEDDING_ARCHITECTURES`), a copy under that architecture, made once
    into the weights cache (:func:`engine.llama.weights.cached_copy`, kind ``embed``): every key
    ``<arch>.*`` renamed ``<twin>.*``, tensors and other keys as they are (the ``gguf`` package,
    llama.cpp's own writer); else ``path`` itself.

    Raises:
        ConfigError: unreadable file; the cache is not writable. RuntimeError: llama.cpp refused it.
    """
    arch = metadata_value(path, "general.architecture")
    twin = EMBEDDING_ARCHITECTURES.get(arch or "")
    if twin is None:
        return path
    return cached_copy(path, "embed", lambda out: _write_as(path, out, arch, twin),
                       f"writing {path} as llama.cpp's {twin} architecture once", folder)


def _write_as(path: str, out: str, arch: str, twin: str) -> None:
    """Write GGUF ``path`` to ``out`` with architecture ``twin`` (keys ``<arch>.*`` renamed)."""
    import gguf  # only when a copy is made: reading the file's fields takes seconds

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, arch=twin)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue  # the header's own fields; the architecture the writer sets
        if name == gguf.Keys.General.ALIGNMENT:
            writer.data_alignment = field.contents()
        kind = field.types[0]
        key = twin + name[len(arch):] if name.startswith(arch + ".") else name
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def normalized(vector: np.ndarray) -> np.ndarray:
    """``vector`` over its Euclidean norm (OpenAI's embeddings are unit vectors; llama-server's
    default ``embd_normalize`` 2, ``common_embd_normalize``); a zero vector stays zero."""
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    return (vector / norm).astype(np.float32) if norm > 0 else vector.astype(np.float32)


class EmbeddingModel(Context):
    """One llama.cpp context that pools every sequence of a batch into one vector
    (``embeddings`` on; ``pooling`` one of :data:`POOLING_TYPES`'s keys).

    Its KV cache is llama.cpp's unified one of ``n_batch`` cells (the engine's
    ``max(n_batch, max_seq_len)``, rounded up to a multiple of ``max_slots``, then of
    :data:`CTX_PAD`): a step decodes whole inputs, at most ``n_batch``
    tokens of at most ``max_slots`` sequences (``n_seq_max``, llama.cpp allows 256) in one
    micro-batch (``n_ubatch = n_batch``, rounded so: llama.cpp pools a sequence only when all of
    it is in one micro-batch), and :meth:`clear` empties it after. No KV pages are given back:
    the cache is that small. Every
    token of a batch is an output (llama.cpp requires it of a pooled embedding); for a causal LM
    llama.cpp also computes each token's logits, in buffers of ``n_batch * n_vocab`` floats.

    ``name``: the model as messages name it (default ``path``; :meth:`from_config` names the
    configured file, not a converted copy of its weights).

    Attributes:
        n_embd: the vector's dimension (``llama_model_n_embd_out``: the hidden size, or the last
            dense projection's where the GGUF has some).
        pooling: llama.cpp's pooling in force (``llama_pooling_type(ctx)``): MEAN, CLS or LAST.
    Raises:
        ConfigError: unreadable or non-GGUF file; the model declares no pooling (or a reranker's)
        and none is configured. RuntimeError: llama.cpp refused the model or could not allocate the context.
    """

    def __init__(self, path: str, max_slots: int, n_batch: int, n_threads: int, pooling: str = "",
                 backend: Backend = CPU, name: str | None = None):
        super().__init__(path, n_threads, backend)
        name = name or path
        try:
            # llama.cpp reserves its worst-case graph for a micro-batch rounded up to a multiple of
            # n_seq_max, with outputs for the micro-batch's own size: pooling's matrices then
            # disagree (GGML_ASSERT(ggml_can_mul_mat(a, b)) in llama_init_from_model, for 640
            # tokens and 24 sequences). A micro-batch that is a multiple already is not rounded.
            n_ubatch = -(-n_batch // max_slots) * max_slots
            params = self._params(n_ubatch)
            params.embeddings = True
            params.pooling_type = POOLING_TYPES[pooling]
            params.kv_unified = True  # one cache for every sequence: a step's inputs are one micro-batch
            # Not flash attention: llama.cpp's CPU kernel for it, over one cache that several
            # sequences share, gives a short input batched with others of 64 tokens or more
            # another vector (cosine 0.25 for two tokens beside 62; bench/README.md,
            # "Embeddings"); the plain attention gives the same vector alone or batched.
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            params.n_ctx = -(-n_ubatch // CTX_PAD) * CTX_PAD
            params.n_seq_max = max_slots
            self.ctx = self._context(params)
            self.pooling = llama_cpp.llama_pooling_type(self.ctx)
            if self.pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
                raise ConfigError(f"the model {name} declares no pooling for embeddings: set pooling "
                                  "(mean, cls or last)")
            if self.pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK:  # its "vector" is n_cls_out scores
                raise ConfigError(f"the model {name} declares rank pooling (a reranker), not embeddings: set pooling "
                                  "(mean, cls or last)")
        except BaseException:
            self.close()
            raise
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_embd = llama_cpp.llama_model_n_embd_out(self.model)

    @classmethod
    def from_config(cls, config: "EngineConfig", backend: Backend | None = None) -> "EmbeddingModel":
        """The embedding model of an engine with ``config`` (kind ``embed``), on ``backend``
        (default: the one llama.cpp reports), its weights in the configured format
        (:func:`engine.llama.weights.weights_path`).

        Raises:
            ConfigError: as the constructor; or the vector is longer than ``max_seq_len``, the
            mailbox row that carries it (:meth:`shm.mailbox.Mailboxes.publish_vector`).
        """
        backend = backend or detect(deterministic=config.deterministic)
        path = embedding_weights_path(weights_path(config.model_path, config.weights, backend=backend))
        model = cls(path, config.max_slots, max(config.n_batch, config.max_seq_len), config.threads, config.pooling,
                    backend, config.model_path)
        if model.n_embd > config.max_seq_len:
            model.close()
            raise ConfigError(f"the model's embeddings have {model.n_embd} dimensions, more than max_seq_len "
                              f"({config.max_seq_len}), which bounds a vector in shared memory: set max_seq_len "
                              f"to at least {model.n_embd}")
        return model

    def embedding(self, seq_id: int) -> np.ndarray | None:
        """Sequence ``seq_id``'s pooled vector from the last decode, normalized
        (:func:`normalized`): float32 ``[n_embd]``, a copy; None when llama.cpp has none for it
        (``llama_get_embeddings_seq`` returned NULL: the sequence was not in the batch)."""
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, seq_id)
        if not ptr:
            return None
        return normalized(np.ctypeslib.as_array(ptr, shape=(self.n_embd,)))

    def clear(self) -> None:
        """Empty the KV cache (``llama_memory_clear``, data too): the next batch starts afresh."""
        llama_cpp.llama_memory_clear(self.mem, True)
