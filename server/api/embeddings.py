"""``POST /v1/embeddings``'s body (OpenAI API reference: Embeddings, ``CreateEmbeddingRequest``)
parsed into an :class:`~server.generation.request.EmbeddingRequest`, each refusal naming the field as sent.

``input`` is a string, an array of strings, an array of token ids, or an array of arrays of
token ids (OpenAI's four forms), at most :data:`MAX_INPUTS` inputs, none empty. Token ids are
the served model's own vocabulary (as OpenAI's for its models, and vLLM's): LangChain's
``OpenAIEmbeddings`` counts text with tiktoken and sends OpenAI's ids unless told
``check_embedding_ctx_length=False`` (docs/models.md, "Embeddings"). ``truncate_prompt_tokens``
(vLLM's extension) keeps an input's last *k* tokens instead of refusing a long one.
"""
from __future__ import annotations

from engine.errors import InvalidRequest
from server.api.fields import FieldPolicy, check_number, number, priority, shown
from server.generation.request import EmbeddingRequest

#: OpenAI's limit on inputs in one request.
MAX_INPUTS = 2048
ENCODINGS = ("float", "base64")
EMBEDDINGS = FieldPolicy(frozenset({"input", "model", "encoding_format", "dimensions", "user",
                                    "truncate_prompt_tokens", "priority"}),
                         informational={"user": str})


def parse_embedding(body: dict) -> EmbeddingRequest:
    """The body -> the request.

    Raises:
        InvalidRequest: the first field that is refused, named as sent (``input[3]``).
    """
    EMBEDDINGS.check(body)
    if "input" not in body:
        raise InvalidRequest("input is required", "input")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODINGS:
        raise InvalidRequest(f"encoding_format must be one of {', '.join(ENCODINGS)}, got {shown(fmt)}",
                             "encoding_format")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and truncate != -1:
        truncate = check_number("truncate_prompt_tokens", truncate, lo=1, integer=True)
    return EmbeddingRequest(_inputs(body["input"]), fmt or "float",
                            number(body, "dimensions", lo=1, integer=True), truncate, priority(body.get("priority")))


def _inputs(value) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        return (_text(value, "input"),)
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string, an array of strings, an array of token ids or an array of "
                             "arrays of token ids, and not empty", "input")
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(f"input holds {len(value)} inputs; at most {MAX_INPUTS}", "input")
    if all(_is_int(v) for v in value):  # one input of token ids
        bad = next((i for i, v in enumerate(value) if v < 0), None)
        if bad is not None:
            raise InvalidRequest(f"input[{bad}] must be a token id (a non-negative integer), got {value[bad]}", "input")
        return (tuple(value),)
    texts = isinstance(value[0], str)  # OpenAI's forms: strings, or arrays of token ids, not both
    out = []
    for i, item in enumerate(value):
        if texts and isinstance(item, str):
            out.append(_text(item, f"input[{i}]"))
        elif not texts and isinstance(item, list) and item and all(_is_id(t) for t in item):
            out.append(tuple(item))
        else:
            kind = "a non-empty string" if texts else "a non-empty array of token ids (non-negative integers)"
            raise InvalidRequest(f"input[{i}] must be {kind}, as input[0] is" if i else
                                 "input[0] must be a non-empty string or a non-empty array of token ids", f"input[{i}]")
    return tuple(out)


def _text(text: str, param: str) -> str:
    if not text:
        raise InvalidRequest(f"{param} must not be empty", param)
    return text


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id(value) -> bool:
    return _is_int(value) and value >= 0
