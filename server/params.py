"""Request bodies -> validated generation requests (OpenAI API reference: Chat Completions,
Completions). Every rejection is a 400 naming the field (``param``)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import falcon
import ujson

from engine.client import SamplingParams
from server.errors import APIError, bad_request

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_N = 16
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20
PRIORITIES = ("high", "normal", "low")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


@dataclass
class GenerationRequest:
    """What one HTTP request asks of the engine, before tokenization of the prompt.

    Attributes:
        max_tokens: None = up to the sequence limit. logprobs: None = not asked, else top-k.
        stop: stop strings (text, applied by the front end).
    """

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    sampling: dict = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    ignore_eos: bool = False
    priority: str = "normal"
    deadline_ms: float | None = None

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=self.ignore_eos,
                              logprobs=self.logprobs, **self.sampling)


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
        raise bad_request(f"request body could not be read: {type(e).__name__}") from None
    if len(raw) > max_body_bytes:
        raise too_large
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = ujson.loads(text)
    except (ValueError, OverflowError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(text):
        try:  # a \ud800-style escape decodes to half a UTF-16 pair: text that cannot be UTF-8
            ujson.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("request body contains an unpaired UTF-16 surrogate escape") from None
    return body


def number(body: dict, name: str, lo: float, hi: float, *, integer: bool = False,
           lo_open: bool = False, default=None):
    """Field ``name`` as a finite number in ``[lo, hi]`` (``(lo, hi]`` if ``lo_open``)."""
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)) or \
            (integer and isinstance(value, float) and not value.is_integer()):
        raise bad_request(f"{name} must be {kind}, got {_shown(value)}", name)
    # Compared as given: a 400-digit integer must not be converted to float (OverflowError).
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request(f"{name} must be in {bound}, got {_shown(value)}", name)
    return int(value) if integer else float(value)


def _shown(value, limit: int = 40) -> str:
    """A request value for an error message, cut to ``limit`` characters."""
    text = ujson.dumps(value, ensure_ascii=False) if not isinstance(value, int) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {ujson.dumps(value)}", name)
    return value


def check_model(body: dict, model_id: str) -> None:
    """``model`` may be absent or the served id; anything else is 404 ``model_not_found``."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model is not None and model != model_id:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {model_id!r}",
                       param="model", code="model_not_found")


def parse_generation(body: dict, *, chat: bool) -> GenerationRequest:
    """Fields common to chat and completions (and their extensions)."""
    r = GenerationRequest()
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = number(body, name, 1, 2**31 - 1, integer=True)  # both validated when both given
        if value is not None and (r.max_tokens is None or name == "max_completion_tokens"):
            r.max_tokens, r.max_tokens_param = value, name  # the newer name wins, as in OpenAI's API
    _refuse_unsupported(body, chat)
    r.sampling = {
        "temperature": number(body, "temperature", 0, 2, default=1.0),
        "top_p": number(body, "top_p", 0, 1, lo_open=True, default=1.0),
        "top_k": number(body, "top_k", 0, 2**31 - 1, integer=True, default=0),
        "min_p": number(body, "min_p", 0, 1, default=0.0),
        "presence_penalty": number(body, "presence_penalty", -2, 2, default=0.0),
        "frequency_penalty": number(body, "frequency_penalty", -2, 2, default=0.0),
        "repeat_penalty": number(body, "repeat_penalty", 0, 10, lo_open=True, default=1.0),
    }
    seed = number(body, "seed", -2**63, 2**64 - 1, integer=True)
    if seed is not None:
        r.sampling["seed"] = seed % 2**32
    r.stop = _stops(body.get("stop"))
    r.n = number(body, "n", 1, MAX_N, integer=True, default=1)
    r.stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        r.include_usage = boolean(options, "include_usage") and r.stream
    r.ignore_eos = boolean(body, "ignore_eos")
    r.logprobs = _logprobs(body, chat)
    r.priority = parse_priority(body)
    r.deadline_ms = number(body, "deadline_ms", 0, 1e9, lo_open=True)
    return r


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Options this server does not implement are refused, not silently ignored."""
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    if chat:
        if body.get("tools") or body.get("functions"):
            raise bad_request("tools are not supported by this server", "tools" if body.get("tools") else "functions")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise bad_request("response_format other than {\"type\": \"text\"} is not supported",
                              "response_format")
        return
    if body.get("echo"):
        raise bad_request("echo is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise bad_request("best_of is not supported (only 1)", "best_of")
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")


def parse_priority(body: dict) -> str:
    """``priority`` extension: ``high`` | ``normal`` (absent or null) | ``low``."""
    priority = "normal" if body.get("priority") is None else body["priority"]
    if priority not in PRIORITIES:
        raise bad_request(f"priority must be one of {', '.join(PRIORITIES)}, got {ujson.dumps(priority)}",
                          "priority")
    return priority


def _stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop may hold at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return [s for s in stops if s]


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        if not boolean(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
            return None
        return number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True, default=0)
    return number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)


def parse_messages(body: dict) -> list[dict]:
    """``messages`` -> ``[{"role", "content": str}]``; text parts are joined, others rejected."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {ujson.dumps(role)}",
                              f"{where}.role")
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content", role)})
    return out


def _content(content, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where)
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{where}[{k}] must be an object with a type", f"{where}[{k}]")
        if part["type"] != "text":
            raise bad_request(f"{where}[{k}] has type {part['type']!r}; this model accepts text parts only",
                              f"{where}[{k}]")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{k}].text must be a string", f"{where}[{k}].text")
        texts.append(part["text"])
    return "".join(texts)


def parse_prompt(body: dict) -> str:
    """``prompt`` of /v1/completions: a string or a list of exactly one string."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string or a list of one string", "prompt")
    return prompt
