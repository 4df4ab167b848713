"""The one room for llama.cpp: every module that calls llama-cpp-python's low-level API is here.

* :mod:`engine.llama.library`: initialization, log sink, loading a GGUF, metadata, devices;
* :mod:`engine.llama.backend`: the device profile (CPU or GPU) and the choices it carries;
* :mod:`engine.llama.weights`: the weight format computed with (a copy converted once);
* :mod:`engine.llama.model`: one context and its KV cache (``Model.from_config``), and what every
  context shares (``Context``);
* :mod:`engine.llama.embedding`: an embedding context, pooling each sequence into one unit vector
  (``EmbeddingModel.from_config``);
* :mod:`engine.llama.kv_pages`: the KV memory of streams that hold nothing given back to the kernel,
  on the cache layouts it knows (one cache; interleaved sliding window), the others refused;
* :mod:`engine.llama.batch`: the ``llama_batch`` the engine fills;
* :mod:`engine.llama.sampler`: per-sequence sampler chains and the constraint slot;
* :mod:`engine.llama.logprobs`: log-probabilities of generated and prompt tokens, many rows at once;
* :mod:`engine.llama.grammar`: grammar constraints (llguidance) compiled over the vocabulary;
* :mod:`engine.llama.tokenizer`: the front ends' tokenizer (the GGUF loaded ``vocab_only``): the
  engine sees token ids only, but every call into llama.cpp lives in this package.
"""
