"""A refusal from the chat path, named in the Responses request's own terms: the chat body a
Responses request means (``server/responses/request.py``) is checked by the chat parsers and
the generator, whose errors name chat fields (``max_tokens``, ``response_format...``,
``tools[i].function...``, ``messages[k]...``). Each is renamed to the field the client sent,
in ``param`` and in the message alike; a chat message's path goes back to the input item (or
``instructions``, or the stored conversation of ``previous_response_id``) it was made from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_FIELDS = [(re.compile(r"^max_tokens$"), "max_output_tokens"),
           (re.compile(r"^response_format\.json_schema(.*)$"), r"text.format\1"),
           (re.compile(r"^response_format(.*)$"), r"text.format\1"),
           (re.compile(r"^tools\[(\d+)\]\.function(.*)$"), r"tools[\1]\2"),
           (re.compile(r"^tool_choice\.function\.name$"), "tool_choice.name")]
_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")
_CALL = re.compile(r"^\.tool_calls\[(\d+)\](.*)$")
#: A chat tool call's fields as a ``function_call`` item's.
_CALL_FIELDS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id"}
_PATH = re.compile(r"\b(?:max_tokens|response_format|tools|tool_choice|messages)\b[\w.\[\]]*")


@dataclass
class Origin:
    """Where one chat message came from: ``path`` (``input[i]``, ``instructions``,
    ``previous_response_id``), its role, and the ``function_call`` item of each of its
    ``tool_calls`` (consecutive calls are one assistant message)."""

    path: str
    role: str
    calls: list[str] = field(default_factory=list)


def responses_param(param: str | None, origins: list[Origin]) -> str | None:
    """The Responses field a chat ``param`` came from; ``origins``: one per chat message."""
    if param is None:
        return None
    m = _MESSAGE.match(param)
    if m:
        return _message_path(int(m.group(1)), m.group(2), origins)
    if param == "messages":
        return "input"
    for pattern, replacement in _FIELDS:
        if pattern.match(param):
            return pattern.sub(replacement, param)
    return param


def responses_message(message: str, origins: list[Origin]) -> str:
    """``message`` with every chat field path in it renamed as :func:`responses_param` does."""
    def rename(match: re.Match) -> str:
        path = match.group(0).rstrip(".")
        if path == "messages":  # the word, in prose
            return match.group(0)
        return responses_param(path, origins) + match.group(0)[len(path):]

    return _PATH.sub(rename, message)


def _message_path(k: int, rest: str, origins: list[Origin]) -> str:
    if k >= len(origins):
        return "input"
    origin = origins[k]
    call = _CALL.match(rest)
    if call and int(call.group(1)) < len(origin.calls):
        return origin.calls[int(call.group(1))] + _CALL_FIELDS.get(call.group(2), "")
    if rest == ".tool_call_id":
        return origin.path + ".call_id"
    if rest.startswith(".content") and origin.path.startswith("input"):
        return origin.path + (".output" if origin.role == "tool" else ".content")
    if rest == ".role" and origin.path.startswith("input"):
        return origin.path + ".role"
    return origin.path
