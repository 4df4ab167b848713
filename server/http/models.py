"""``GET /v1/models`` and ``GET /v1/models/{model}`` (OpenAI API reference: Models)."""
from __future__ import annotations

import time

import falcon

from server.api.errors import ModelNotFound
from server.config import ServerConfig

#: What every model serves: completions (``/v1/completions``, scoring, ``/infer``, gRPC
#: ``Infer``). With a chat template, chat too (``/v1/chat/completions`` with tools and structured
#: outputs, ``/v1/responses``, gRPC ``ChatComplete``).
COMPLETION, CHAT = "completion", "chat"


class Models:
    """The served model under each of its names (``--model-id``, by default the GGUF's name and
    ``local-model``), with two extensions of OpenAI's model object: ``context_length``, the
    real per-sequence token limit, and ``capabilities``, what it can serve (``["completion",
    "chat"]``, or ``["completion"]`` for a model without a chat template; Ollama's word for the
    same list). Every GET answers HEAD too (HTTP requires it).

    Args:
        chat: the server has a chat template (``Generator.template`` is not None).
    """

    def __init__(self, config: ServerConfig, chat: bool):
        self.config = config
        self.created = int(time.time())
        self.capabilities = [COMPLETION, CHAT] if chat else [COMPLETION]

    def card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "local",
                "context_length": self.config.max_seq_len, "capabilities": self.capabilities}

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"object": "list", "data": [self.card(name) for name in self.config.model_ids]}

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model: str) -> None:
        if not model:  # "/v1/models/": no model named, so no such route
            raise falcon.HTTPNotFound()
        if model not in self.config.model_ids:
            raise ModelNotFound(f"The model {model!r} does not exist", "model")
        resp.media = self.card(model)

    on_head = on_get
    on_head_one = on_get_one
