"""``GET /v1/models`` and ``GET /v1/models/{model}`` (OpenAI API reference: Models)."""
from __future__ import annotations

import time

import falcon

from server.api.errors import ModelNotFound
from server.model_router import ModelRouter, ServedModel

#: What a model serves: a generation model completions (``/v1/completions``, scoring,
#: ``/infer``, gRPC ``Infer``), and with a chat template chat too (``/v1/chat/completions`` with
#: tools and structured outputs, ``/v1/responses``, gRPC ``ChatComplete``); an embedding model
#: embeddings (``/v1/embeddings``, gRPC ``Embed``).
COMPLETION, CHAT, EMBEDDING = "completion", "chat", "embedding"


class Models:
    """Every model the key may use, under each of its names (a models file's ``names``,
    ``--model-id``, by default the GGUF's name and, for the first model, ``local-model``), with
    three extensions of OpenAI's model object: ``context_length``, the real per-sequence token
    limit; ``capabilities``, what it can serve (``["completion", "chat"]``, ``["completion"]``
    for a model without a chat template, ``["embedding"]``; Ollama's word for the same list);
    and ``root``, the model's id (vLLM's field: the same model under each alias). A model the
    key may not use is not listed, and is 404 as one that does not exist. Every GET answers
    HEAD too (HTTP requires it).
    """

    def __init__(self, models: ModelRouter):
        self.models = models
        self.created = int(time.time())

    def card(self, name: str, served: ServedModel) -> dict:
        capabilities = [EMBEDDING] if served.embedder is not None else \
            [COMPLETION, CHAT] if served.chat else [COMPLETION]
        return {"id": name, "object": "model", "created": self.created, "owned_by": "local",
                "root": served.spec.id, "context_length": served.engine.max_seq_len, "capabilities": capabilities}

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"object": "list", "data": [self.card(name, m)
                                                 for name, m in self.models.visible(req.context.tenant)]}

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model: str) -> None:
        if not model:  # "/v1/models/": no model named, so no such route
            raise falcon.HTTPNotFound()
        served = self.models.by_name.get(model)
        if served is None or not req.context.tenant.may_use(served.spec.names):
            raise ModelNotFound(f"The model {model!r} does not exist or you do not have access to it", "model")
        resp.media = self.card(model, served)

    on_head = on_get
    on_head_one = on_get_one
