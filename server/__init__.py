"""The inference server's front ends, over the engine process (``engine/``, reached only through
:class:`engine.client.EngineClient`).

Entry points, at documented paths: :mod:`server.cli` (``inference-server``),
:mod:`server.gunicorn_conf` and :mod:`server.wsgi` (``gunicorn -c python:server.gunicorn_conf
server.wsgi:app``), with :mod:`server.config` their settings. :mod:`server.errors` maps the
engine's domain errors to HTTP and gRPC, in one place.

Packages, by concept:

- :mod:`server.api`: the request schema, protocol-neutral (OpenAI fields, ``/infer``).
- :mod:`server.http`: the Falcon app, its middleware and resources, the gunicorn worker class.
- :mod:`server.grpc`: the gRPC service, its sidecar process and the master's keeper of it.
- :mod:`server.generation`: the request path both front ends share (prepare, admit, submit,
  follow, detokenize; usage and timings).
- :mod:`server.text`: tokenizer, detokenizer and chat template.
- :mod:`server.tenancy`: tenants, API keys and rate limits.
- :mod:`server.observability`: request telemetry, Prometheus metrics, their multiprocess directory.

Imports go one way: ``http`` and ``grpc`` use ``api``, ``generation``, ``tenancy`` and
``observability``, never each other.
"""
