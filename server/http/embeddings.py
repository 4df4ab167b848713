"""``POST /v1/embeddings`` (OpenAI API reference: Embeddings): the Falcon resource around
:func:`server.api.embeddings.parse_embedding` and the model's
:class:`~server.generation.embedding.Embedder`."""
from __future__ import annotations

import base64

import falcon

from server.api.embeddings import parse_embedding
from server.config import ServerConfig
from server.model_router import EMBEDDINGS, ModelRouter
from server.http.body import read_json
from server.http.json import dumps


class Embeddings:
    """``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
    "usage": {"prompt_tokens", "total_tokens"}}``; ``embedding`` a list of floats, or with
    ``encoding_format: "base64"`` the float32 vector's little-endian bytes in base64 (what
    OpenAI's SDK asks for by default and decodes with ``numpy.frombuffer``)."""

    observed = True  # telemetry and admission (server/http/middleware.py)

    def __init__(self, config: ServerConfig, models: ModelRouter):
        self.config, self.models = config, models

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        model, served, tenant = self.models.pick(body, req.context.tenant, EMBEDDINGS)
        request = parse_embedding(body)
        run = served.embedder.start(request, tenant, watch_socket=req.env.get("gunicorn.socket"))
        req.context.record.attach(run, body["input"])
        result = run.result()
        vectors = result.vectors.astype("<f4", copy=False)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.tobytes()).decode("ascii") if request.encoding_format == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps({"object": "list", "data": data, "model": model,
                           "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}})
