"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, in vLLM's shapes (vLLM's
``vllm/entrypoints/serve/tokenize/api_router.py``): lm-evaluation-harness's ``local-completions``
finds them by ``GET /tokenizer_info`` and then needs no Hugging Face tokenizer (its
``RemoteTokenizer``). The same API keys as the model routes; not counted as generation requests
(``observed`` False)."""
from __future__ import annotations

import falcon

from engine.request import check_prompt_fits
from server.api.tokenize import parse_detokenize, parse_tokenize
from server.config import ServerConfig
from server.model_router import ANY, CHAT, ModelRouter
from server.http.body import read_json
from server.http.completions import token_text


class Tokenize:
    """``POST /tokenize`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``.

    A ``prompt`` is tokenized with special-token text parsed (``<|im_end|>`` is that token), as
    vLLM's Hugging Face tokenizers do; ``messages`` (with ``tools``) as ``/v1/chat/completions`` renders
    them (:meth:`Generator.prompt_ids`: the chat template, message text never parsed for special
    tokens)."""

    def __init__(self, config: ServerConfig, models: ModelRouter):
        self.config, self.models = config, models

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        served = self.models.pick(body, req.context.tenant, CHAT if "messages" in body else ANY).model
        r = parse_tokenize(body, self.config.max_messages)
        tok, max_seq_len = served.tokenizer, served.engine.max_seq_len
        if r.prompt is not None:
            tokens = tok.encode(r.prompt, special=True, add_bos=r.add_special_tokens)
        else:
            tokens = served.generator.prompt_ids(r.messages, r.tools, r.render)
            check_prompt_fits(len(tokens), max_seq_len, "messages")  # as the chat refuses it
            if r.add_special_tokens and tok.add_bos:
                tokens = [tok.bos] + tokens
        resp.media = {"count": len(tokens), "max_model_len": max_seq_len, "tokens": tokens,
                      "token_strs": [token_text(tok.piece(t, special=True)) for t in tokens]
                      if r.return_token_strs else None}


class Detokenize:
    """``POST /detokenize`` -> ``{"prompt"}``: the text of ``tokens``, special tokens written as
    their text (as a Hugging Face tokenizer's ``decode``)."""

    def __init__(self, config: ServerConfig, models: ModelRouter):
        self.config, self.models = config, models

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        tok = self.models.pick(body, req.context.tenant, ANY).model.tokenizer
        resp.media = {"prompt": tok.decode(parse_detokenize(body, tok.n_vocab), special=True)}


class TokenizerInfo:
    """``GET /tokenizer_info``: what a client needs to tokenize as the server does (vLLM answers
    the tokenizer's configuration): the special tokens (``eos_token`` is the one generation ends
    with, ``bos_token`` the document start), the chat template (null: the model has none, and
    serves no chat), the length limit."""

    def __init__(self, config: ServerConfig, models: ModelRouter):
        self.models = models
        self.info = {m.spec.id: self.describe(m) for m in models.models}

    @staticmethod
    def describe(served) -> dict:
        tok, template = served.tokenizer, served.generator.template if served.generator is not None else None
        return {"tokenizer_class": "llama.cpp (GGUF vocabulary)", "model_max_length": served.engine.max_seq_len,
                "vocab_size": tok.n_vocab, "add_bos_token": tok.add_bos,
                "bos_token": tok.token_text(tok.bos), "eos_token": tok.token_text(tok.eos), "pad_token": None,
                "chat_template": template.source if template is not None else None}

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``?model=NAME`` picks the model (the default one without it)."""
        body = {"model": req.get_param("model")} if req.get_param("model") is not None else {}
        resp.media = self.info[self.models.pick(body, req.context.tenant, ANY).model.spec.id]

    on_head = on_get
