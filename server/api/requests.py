"""Chat Completions and Completions bodies (JSON objects, from HTTP or a gRPC message's fields)
-> a :class:`GenerationRequest` and messages or prompts (OpenAI API reference: Chat
Completions, Completions). Every rejection is an :class:`engine.errors.InvalidRequest` naming the
field as the client sent it; the checks are ``server/api/fields.py``'s, the bounds of sampling
fields :class:`engine.request.SamplingParams`'s. Reading an HTTP body is ``server/http/body.py``'s."""
from __future__ import annotations

from typing import Callable

import ujson

from engine.errors import InvalidRequest
from engine.request import DEADLINE_MS_BOUNDS, INT32_MAX, LOGIT_BIAS_BOUNDS, SamplingParams, reduce_seed
from server.api.errors import ModelNotFound
from server.api.fields import FieldPolicy, boolean, check_number, number, priority, shown
from server.api.tools import message_tool_fields, parse_tools
from server.generation.request import GenerationRequest
from server.structured.constraint import OutputConstraint
from server.api.structured import parse_structured
from server.tools.spec import ToolRequest

CHAT_ROLES = ("system", "developer", "user", "assistant")
ROLES = (*CHAT_ROLES, "tool")  # a tool message must answer an earlier call
MAX_N = 128  # OpenAI's bound; what fits is bounded by the server's capacity (a 400 beyond it)
#: OpenAI takes 4 stop strings and vLLM any number; lm-eval's completions client sends a task's
#: ``until`` strings and the end-of-text string (5 for a task of 4: refused, the whole run ended).
MAX_STOPS = 32


def sampling_field(body: dict, name: str, field_name: str | None = None):
    """Body field ``name`` checked with the bounds of SamplingParams field ``field_name``
    (default: the same name); None when absent."""
    return number(body, name, **SamplingParams.bounds(field_name or name))


def check_model(body: dict, model_ids: tuple[str, ...]) -> str:
    """``model`` may be absent (the first served name) or any served name (aliases, as vLLM's
    ``--served-model-name``); anything else is 404 ``model_not_found``. Returns the name a
    response echoes."""
    model = body.get("model")
    if model is None:
        return model_ids[0]
    if not isinstance(model, str):
        raise InvalidRequest("model must be a string", "model")
    if model not in model_ids:
        raise ModelNotFound(f"The model {model!r} does not exist; this server serves {', '.join(model_ids)}", "model")
    return model


# -- which fields each route takes -------------------------------------------------------------------
#: Fields both routes implement (OpenAI's and this server's extensions).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
           "presence_penalty", "frequency_penalty", "seed", "logprobs", "logit_bias", "user",
           "top_k", "min_p", "repeat_penalty", "ignore_eos", "priority", "deadline_ms",
           "response_format", "structured_outputs"}
CHAT_FIELDS = frozenset(_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "continue_final_message", "add_generation_prompt",
    "tools", "tool_choice", "parallel_tool_calls",  # server/api/tools.py
    # accepted because they cannot change what this server generates (docs/api.md "API"):
    "safety_identifier", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options",
    # served only at their default value, refused otherwise (docs/api.md "API"):
    "store", "modalities", "functions", "function_call", "audio",
    "prediction", "web_search_options", "reasoning_effort", "verbosity", "moderation"})
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "best_of", "echo", "suffix"})

#: Accepted fields with no effect here still get OpenAI's types, so a client's mistake is seen
#: (the Responses API's policy takes them too).
INFORMATIONAL = {"user": str, "safety_identifier": str, "service_tier": str, "prompt_cache_key": str,
                 "prompt_cache_retention": str, "prompt_cache_options": dict}
CHAT = FieldPolicy(CHAT_FIELDS, {
    "functions": ([[]], "functions (deprecated) are not supported: send tools"),
    "function_call": (["none", "auto"], "function_call (deprecated) other than none/auto is not supported: send "
                                        "tool_choice"),
    "store": ([False], "store is not supported: completions are not stored"),
    "modalities": ([["text"]], "modalities other than [\"text\"] are not supported"),
    "audio": ([], "audio output is not supported"),
    "prediction": ([], "predicted outputs are not supported"),
    "web_search_options": ([], "web search is not supported"),
    "reasoning_effort": ([], "reasoning_effort is not supported: the model does not reason"),
    "verbosity": (["medium"], "verbosity other than medium (the default) is not supported"),
    "moderation": ([], "moderation is not supported"),
}, INFORMATIONAL)
COMPLETIONS = FieldPolicy(COMPLETION_FIELDS, {
    "suffix": ([""], "suffix is not supported"),
    "best_of": ([0, 1], "best_of is not supported (only 1)"),
}, INFORMATIONAL)


def parse_generation(body: dict, *, chat: bool) -> GenerationRequest:
    """The fields common to chat and completions (and their extensions) -> the request.

    Raises:
        InvalidRequest: the first field that is refused, named as sent.
    """
    (CHAT if chat else COMPLETIONS).check(body)
    return generation_request(body, chat=chat, structured=lambda: parse_structured(body),
                              tools=lambda: parse_tools(body) if chat else None)


def generation_request(body: dict, *, chat: bool, structured: Callable[[], OutputConstraint | None],
                       tools: Callable[[], ToolRequest | None]) -> GenerationRequest:
    """The request of ``body``'s generation fields, after the route's field policy; the
    structured-output constraint and the tools come from ``structured()``
    and ``tools()``, called in the order the fields are checked (a body's first fault is the one
    named), so a protocol whose shapes for them differ (gRPC) parses them its own way."""
    max_tokens, max_tokens_param = None, "max_tokens"
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = number(body, name, lo=0, hi=INT32_MAX, integer=True)  # both validated when both given
        if value is not None and (max_tokens is None or name == "max_completion_tokens"):
            max_tokens, max_tokens_param = value, name  # the newer name wins, as in OpenAI's API
    kwargs = {name: sampling_field(body, name) for name in _SAMPLING}
    # OpenAI's document bounds seed at ±9223372036854776000 (2**63 as a float); any integer is
    # reduced to a reproducible llama.cpp seed anyway.
    seed = number(body, "seed", lo=-2**64, hi=2**64, integer=True)
    constraint = structured()
    sampling = SamplingParams(
        max_new_tokens=max_tokens or None, seed=None if seed is None else reduce_seed(seed),
        ignore_eos=boolean(body, "ignore_eos"), logprobs=_logprobs(body, chat), logit_bias=_logit_bias(body),
        **{k: v for k, v in kwargs.items() if v is not None})
    stop = _stops(body.get("stop"))
    n = number(body, "n", lo=1, hi=MAX_N, integer=True, default=1)
    stream = boolean(body, "stream")
    include_usage, obfuscate = _stream_options(body.get("stream_options"), stream)
    return GenerationRequest(
        sampling=sampling, max_tokens=max_tokens, max_tokens_param=max_tokens_param, stop=stop, n=n, stream=stream,
        include_usage=include_usage, obfuscate=obfuscate, constraint=constraint,
        tools=tools(), echo=not chat and boolean(body, "echo"),
        priority=priority(body.get("priority")), deadline_ms=number(body, "deadline_ms", **DEADLINE_MS_BOUNDS))


def _stream_options(options, stream: bool) -> tuple[bool, bool]:
    """``stream_options`` -> (``include_usage``, ``include_obfuscation``)."""
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise InvalidRequest(f"Unrecognized stream option: {unknown[0]}", f"stream_options.{unknown[0]}")
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    obfuscate = boolean(options, "include_obfuscation", where="stream_options.")
    return boolean(options, "include_usage", where="stream_options."), obfuscate


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object mapping token ids (decimal strings, as JSON keys are) to
    a bias in [-100, 100], added to the token's logit before sampling (-100 bans it, 100 forces
    it). A key is the id as the tokenizer writes it, without leading zeros: "021285" and
    "21285" would otherwise be two entries for one token, and llama.cpp would add both biases up.
    The ids are checked against the vocabulary by the generator, which knows it."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10
                and key == str(int(key))):
            raise InvalidRequest(f"logit_bias keys must be token ids (non-negative decimal integers without leading "
                                 f"zeros), got {shown(key)}", "logit_bias")
        out.append((int(key), check_number("logit_bias", bias, **LOGIT_BIAS_BOUNDS)))
    return tuple(out)


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")


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


#: Message fields a client library adds to an answer it sends back as history, for itself:
#: nothing for a server to honour, so passed over (LiteLLM up to 1.80 sends an assistant
#: message's ``provider_specific_fields``; vLLM accepts any extra field).
CLIENT_METADATA = ("provider_specific_fields",)


def parse_messages(body: dict, max_messages: int) -> list[dict]:
    """``messages`` -> ``[{"role", "content": str | None, ...}]``: text parts are joined, other
    parts rejected; the tool fields (``name``, an assistant's ``tool_calls``, a tool message's
    ``tool_call_id``) as ``server.api.tools.message_tool_fields`` gives them. At most
    ``max_messages``, checked before anything else is looked at (a refusal is cheap)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", "messages")
    if len(messages) > max_messages:
        raise InvalidRequest(f"messages holds {len(messages)} messages, more than this server's limit of "
                             f"{max_messages}", "messages")
    call_ids: set[str] = set()
    return [parse_message(m, f"messages[{i}]", call_ids) for i, m in enumerate(messages)]


def parse_message(m, where: str, call_ids: set[str]) -> dict:
    """One chat message at ``where`` (``messages[3]``) -> ``{"role", "content": str | None, ...}``
    with its tool fields; ``call_ids``: the ids of earlier calls, which this extends."""
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object", where)
    role = parse_role(m.get("role"), where)
    for key in sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", *CLIENT_METADATA}):
        # function_call, refusal, audio: not implemented; an answer's empty annotations, as
        # OpenAI's own answers carry them, replayed into the next turn
        if m[key] is not None and not (key == "annotations" and m[key] == [] and role == "assistant"):
            raise InvalidRequest(f"{where}.{key} is not supported by this server", f"{where}.{key}")
    tool_fields = message_tool_fields(m, where, role, call_ids)
    content = _content(m.get("content"), f"{where}.content", role, "tool_calls" in tool_fields)
    return {"role": role, "content": content, **tool_fields}


def parse_role(role, where: str) -> str:
    """The ``role`` of the message at ``where``: one of :data:`ROLES`."""
    if role == "function":
        raise InvalidRequest(f"{where}.role 'function' (deprecated) is not supported: send role 'tool'",
                             f"{where}.role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {ujson.dumps(role)}",
                             f"{where}.role")
    return role


def render_options(body: dict, messages: list[dict]) -> dict:
    """``add_generation_prompt`` and ``continue_final_message`` (vLLM's extensions): by default a
    final assistant message is continued (as llama.cpp's server does), otherwise a new assistant
    turn is opened.

    Raises:
        InvalidRequest: a combination that cannot be honoured.
    """
    # An assistant message that made tool calls is answered by tool messages, never continued.
    last_is_assistant = messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]
    add = body.get("add_generation_prompt")
    cont = body.get("continue_final_message")
    for name, value in (("add_generation_prompt", add), ("continue_final_message", cont)):
        if value is not None and not isinstance(value, bool):
            raise InvalidRequest(f"{name} must be a boolean", name)
    if cont is None:
        cont = last_is_assistant and add is not True
    if add is None:
        add = not cont
    if cont and add:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                             "continue_final_message")
    if cont and not last_is_assistant:
        raise InvalidRequest("continue_final_message needs a final assistant message to continue",
                             "continue_final_message")
    return {"add_generation_prompt": add, "continue_final_message": cont}


def _content(content, where: str, role: str, has_calls: bool = False) -> str | None:
    """A message's text; None only for an assistant message that makes tool calls without text
    (what a template is given then, as OpenAI's null content)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return None if has_calls else ""
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


def parse_prompt(body: dict, max_prompts: int) -> list[str | list[int]]:
    """``prompt`` of /v1/completions in any of OpenAI's four forms: a string, an array of
    strings, an array of token ids, or an array of token-id arrays. Returns one entry per
    prompt: text, or token ids (range-checked against the vocabulary later). Absent or null is
    OpenAI's default, ``<|endoftext|>``: the start of a new document."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""  # the generator starts an empty prompt as a new document
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and not is_token(prompt[0]) and len(prompt) > max_prompts:
        # Counted before any element is looked at, so a huge array is refused cheaply.
        raise InvalidRequest(f"prompt holds {len(prompt)} prompts; with n={body.get('n') or 1} this server "
                             f"can run at most {max_prompts}", "prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(is_token(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(is_token(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequest("prompt must be a string, an array of strings, an array of token ids or an array of "
                         "non-empty token-id arrays", "prompt")


def is_token(t) -> bool:
    """A JSON integer (not a boolean): a token id before its range is checked."""
    return isinstance(t, int) and not isinstance(t, bool)
