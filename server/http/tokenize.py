"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, in vLLM's shapes (vLLM's
``vllm/entrypoints/serve/tokenize/api_router.py``): lm-evaluation-harness's ``local-completions``
finds them by ``GET /tokenizer_info`` and then needs no Hugging Face tokenizer (its
``RemoteTokenizer``). The same API keys as the model routes; not counted as generation requests
(``observed`` False)."""
from __future__ import annotations

import falcon

from engine.request import check_prompt_fits
from server.api.requests import check_model
from server.api.tokenize import parse_detokenize, parse_tokenize
from server.config import ServerConfig
from server.generation.pipeline import Generator
from server.http.body import read_json
from server.http.completions import token_text


class Tokenize:
    """``POST /tokenize`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``.

    A ``prompt`` is tokenized with special-token text parsed (``<|im_end|>`` is that token), as
    vLLM's Hugging Face tokenizers do; ``messages`` (with ``tools``) as ``/v1/chat/completions`` renders
    them (:meth:`Generator.prompt_ids`: the chat template, message text never parsed for special
    tokens)."""

    def __init__(self, config: ServerConfig, generator: Generator):
        self.config, self.generator, self.tokenizer = config, generator, generator.tokenizer
        self.max_seq_len = generator.engine.max_seq_len

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        check_model(body, self.config.model_ids)
        r = parse_tokenize(body, self.config.max_messages)
        tok = self.tokenizer
        if r.prompt is not None:
            tokens = tok.encode(r.prompt, special=True, add_bos=r.add_special_tokens)
        else:
            tokens = self.generator.prompt_ids(r.messages, r.tools, r.render)
            check_prompt_fits(len(tokens), self.max_seq_len, "messages")  # as the chat refuses it
            if r.add_special_tokens and tok.add_bos:
                tokens = [tok.bos] + tokens
        resp.media = {"count": len(tokens), "max_model_len": self.max_seq_len, "tokens": tokens,
                      "token_strs": [token_text(tok.piece(t, special=True)) for t in tokens]
                      if r.return_token_strs else None}


class Detokenize:
    """``POST /detokenize`` -> ``{"prompt"}``: the text of ``tokens``, special tokens written as
    their text (as a Hugging Face tokenizer's ``decode``)."""

    def __init__(self, config: ServerConfig, generator: Generator):
        self.config, self.tokenizer = config, generator.tokenizer

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        check_model(body, self.config.model_ids)
        resp.media = {"prompt": self.tokenizer.decode(parse_detokenize(body, self.tokenizer.n_vocab), special=True)}


class TokenizerInfo:
    """``GET /tokenizer_info``: what a client needs to tokenize as the server does (vLLM answers
    the tokenizer's configuration): the special tokens (``eos_token`` is the one generation ends
    with, ``bos_token`` the document start), the chat template (null: the model has none, and
    serves no chat), the length limit."""

    def __init__(self, config: ServerConfig, generator: Generator):
        tok = generator.tokenizer
        self.info = {"tokenizer_class": "llama.cpp (GGUF vocabulary)", "model_max_length": generator.engine.max_seq_len,
                     "vocab_size": tok.n_vocab, "add_bos_token": tok.add_bos,
                     "bos_token": tok.token_text(tok.bos), "eos_token": tok.token_text(tok.eos), "pad_token": None,
                     "chat_template": generator.template.source if generator.template is not None else None}

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.info

    on_head = on_get
