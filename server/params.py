"""Request bodies -> validated generation requests (OpenAI API reference: Chat Completions,
Completions). Every rejection is an :class:`engine.errors.InvalidRequest` naming the field
(``param``); bounds of sampling fields come from :class:`engine.request.SamplingParams`."""
from __future__ import annotations

import re

import falcon
import ujson

from engine.errors import InvalidRequest, ModelNotFound
from engine.request import DEADLINE_MS_BOUNDS, Priority, SamplingParams, check_number
from server.errors import APIError
from server.generation import GenerationRequest

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_N = 16
MAX_STOPS = 4
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def read_json(req: falcon.Request, max_body_bytes: int) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 415 not ``application/json``; 413 over ``max_body_bytes`` (the connection is
        then closed, the body left unread); 400 not UTF-8, not JSON, or not an object.
    """
    media = (req.content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {req.content_type or 'none'}",
                       code="unsupported_media_type")
    encoding = (req.get_header("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise APIError(415, f"Content-Encoding {encoding} is not supported; send plain JSON",
                       code="unsupported_media_type")
    too_large = APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large",
                         headers={"Connection": "close"})
    if req.content_length is not None and req.content_length > max_body_bytes:
        raise too_large
    # Without Content-Length (a chunked body), Falcon's bounded stream reads nothing; gunicorn's
    # own input stream decodes the chunks and ends at the body's end.
    stream = req.bounded_stream if req.content_length is not None else req.stream
    try:
        raw = stream.read(max_body_bytes + 1)
    except Exception as e:  # noqa: BLE001 - gunicorn's malformed-chunk errors have no common base
        raise InvalidRequest(f"request body could not be read: {type(e).__name__}") from None
    if len(raw) > max_body_bytes:
        raise too_large
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = ujson.loads(text)
    except (ValueError, OverflowError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(text):
        try:  # a \ud800-style escape decodes to half a UTF-16 pair: text that cannot be UTF-8
            ujson.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("request body contains an unpaired UTF-16 surrogate escape") from None
    return body


def number(body: dict, name: str, *, default=None, **bounds):
    """Field ``name`` of ``body`` checked by :func:`engine.request.check_number` with
    ``bounds`` (``lo``, ``hi``, ``lo_open``, ``integer``); ``default`` when absent or null."""
    value = body.get(name)
    return default if value is None else check_number(name, value, **bounds)


def sampling_field(body: dict, name: str, field_name: str | None = None):
    """Body field ``name`` checked with the bounds of SamplingParams field ``field_name``
    (default: the same name); None when absent."""
    return number(body, name, **SamplingParams.bounds(field_name or name))


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean, got {ujson.dumps(value)}", name)
    return value


def check_model(body: dict, model_id: str) -> None:
    """``model`` may be absent or the served id; anything else is 404 ``model_not_found``."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", "model")
    if model is not None and model != model_id:
        raise ModelNotFound(f"The model {model!r} does not exist; this server serves {model_id!r}", "model")


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")


def parse_generation(body: dict, *, chat: bool) -> GenerationRequest:
    """Fields common to chat and completions (and their extensions)."""
    r = GenerationRequest()
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = sampling_field(body, name, "max_new_tokens")  # both validated when both given
        if value is not None and (max_tokens is None or name == "max_completion_tokens"):
            max_tokens, r.max_tokens_param = value, name  # the newer name wins, as in OpenAI's API
    _refuse_unsupported(body, chat)
    kwargs = {name: sampling_field(body, name) for name in _SAMPLING}
    seed = number(body, "seed", lo=-2**63, hi=2**64 - 1, integer=True)
    r.sampling = SamplingParams(
        max_new_tokens=max_tokens, seed=None if seed is None else seed % 2**32,
        ignore_eos=boolean(body, "ignore_eos"), logprobs=_logprobs(body, chat),
        **{k: v for k, v in kwargs.items() if v is not None})
    r.stop = _stops(body.get("stop"))
    r.n = number(body, "n", lo=1, hi=MAX_N, integer=True, default=1)
    r.stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        r.include_usage = boolean(options, "include_usage") and r.stream
    r.priority = Priority.parse(body.get("priority"))
    r.deadline_ms = number(body, "deadline_ms", **DEADLINE_MS_BOUNDS)
    return r


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Options this server does not implement are refused, not silently ignored."""
    if body.get("logit_bias"):
        raise InvalidRequest("logit_bias is not supported", "logit_bias")
    if chat:
        if body.get("tools") or body.get("functions"):
            field = "tools" if body.get("tools") else "functions"
            raise InvalidRequest("tools are not supported by this server", field)
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise InvalidRequest("response_format other than {\"type\": \"text\"} is not supported",
                              "response_format")
        return
    if body.get("echo"):
        raise InvalidRequest("echo is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest("best_of is not supported (only 1)", "best_of")
    if body.get("suffix") is not None:
        raise InvalidRequest("suffix is not supported", "suffix")


def _stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"stop may hold at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return [s for s in stops if s]


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        if not boolean(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise InvalidRequest("top_logprobs requires logprobs: true", "top_logprobs")
            return None
        return sampling_field(body, "top_logprobs", "logprobs") or 0
    return sampling_field(body, "logprobs")


def parse_messages(body: dict) -> list[dict]:
    """``messages`` -> ``[{"role", "content": str}]``; text parts are joined, others rejected."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {ujson.dumps(role)}",
                              f"{where}.role")
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content", role)})
    return out


def _content(content, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or an array of text parts", where)
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f"{where}[{k}] must be an object with a type", f"{where}[{k}]")
        if part["type"] != "text":
            raise InvalidRequest(f"{where}[{k}] has type {part['type']!r}; this model accepts text parts only",
                              f"{where}[{k}]")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{k}].text must be a string", f"{where}[{k}].text")
        texts.append(part["text"])
    return "".join(texts)


def parse_prompt(body: dict) -> str:
    """``prompt`` of /v1/completions: a string or a list of exactly one string."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string or a list of one string", "prompt")
    return prompt
