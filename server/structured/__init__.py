"""Structured outputs: what a request's answer must be and the grammar that holds it there.

- ``constraint``: :class:`OutputConstraint`, the typed constraint (kind, value, the client's field).
- ``schema``: the JSON-schema policy (objects closed, compact JSON, every keyword enforced).
- ``check``: whether llguidance can enforce it, checked in child processes (``check_child``)
  and memoized per tenant, before anything reaches the engine.

The request fields that ask for one (``response_format``, ``structured_outputs``,
``text.format``) are parsed into an :class:`OutputConstraint` by ``server/api/structured.py``.
The grammar is written once per request by :class:`server.generation.pipeline.Generator` (with
tools, by ``server/tools/grammar.py``) and compiled by the engine (``engine/llama/grammar.py``).
"""
