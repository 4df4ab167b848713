"""The request schema, protocol-neutral: JSON-object bodies (an HTTP body, or a gRPC message made
into one) -> validated :class:`server.generation.request.GenerationRequest`\\ s.
:mod:`.requests` holds the OpenAI routes' fields, :mod:`.infer` those of ``/infer`` and its
response. Nothing here reads a transport: reading an HTTP body is :mod:`server.http.body`'s."""
