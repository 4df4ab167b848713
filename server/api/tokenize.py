"""Bodies of the tokenizer routes, in vLLM's shapes (``vllm/entrypoints/serve/tokenize``:
``TokenizeCompletionRequest``, ``TokenizeChatRequest``, ``DetokenizeRequest``), so clients written
for vLLM (lm-evaluation-harness's remote tokenizer) work unchanged. Every rejection is an
:class:`engine.errors.InvalidRequest` naming the field."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequest
from server.api.fields import FieldPolicy, boolean
from server.api.requests import is_token, parse_messages, render_options
from server.api.tools import parse_tools
from server.tools.spec import Tool

TOKENIZE = FieldPolicy(frozenset({"model", "prompt", "messages", "tools", "add_special_tokens", "return_token_strs",
                                   "add_generation_prompt", "continue_final_message"}))
DETOKENIZE = FieldPolicy(frozenset({"model", "tokens"}))


@dataclass
class TokenizeRequest:
    """``POST /tokenize``: a text ``prompt`` or chat ``messages`` (one of them).

    Attributes:
        prompt: the text (None for messages). messages: ``[{"role", "content": str}]`` (None
        for a prompt), rendered with ``render`` (:func:`server.api.requests.render_options`).
        add_special_tokens: add the model's BOS to a prompt if it wants one (vLLM's default:
        true for a prompt, false for messages, whose template writes its own).
        return_token_strs: also answer each token's text.
        tools: the ``tools`` the chat is rendered with, as ``/v1/chat/completions`` renders
        them (vLLM's ``TokenizeChatRequest.tools``).
    """

    prompt: str | None = None
    messages: list[dict] | None = None
    render: dict | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tools: tuple[Tool, ...] = ()


def parse_tokenize(body: dict, max_messages: int) -> TokenizeRequest:
    """Raises: InvalidRequest: an unknown field, both or neither of ``prompt`` and
    ``messages``, or a field of the wrong type."""
    TOKENIZE.check(body)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise InvalidRequest("give either prompt (a string) or messages (a chat), not both or neither",
                             "messages" if has_messages else "prompt")
    r = TokenizeRequest(return_token_strs=boolean(body, "return_token_strs"))
    if has_prompt:
        for name in ("add_generation_prompt", "continue_final_message", "tools"):
            if body.get(name) is not None:
                raise InvalidRequest(f"{name} applies to messages only", name)
        if not isinstance(body["prompt"], str):
            raise InvalidRequest("prompt must be a string", "prompt")
        r.prompt = body["prompt"]
        r.add_special_tokens = boolean(body, "add_special_tokens", True)
    else:
        r.messages = parse_messages(body, max_messages)
        r.render = render_options(body, r.messages)
        tools = parse_tools({"tools": body.get("tools")})
        r.tools = tools.tools if tools is not None else ()
        r.add_special_tokens = boolean(body, "add_special_tokens", False)
    return r


def parse_detokenize(body: dict, n_vocab: int) -> list[int]:
    """``tokens``: a list of token ids of the vocabulary.

    Raises:
        InvalidRequest: an unknown field, or ``tokens`` not such a list.
    """
    DETOKENIZE.check(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_token(t) for t in tokens):
        raise InvalidRequest("tokens must be an array of token ids", "tokens")
    outside = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if outside is not None:
        raise InvalidRequest(f"tokens holds {outside}, outside the vocabulary (0..{n_vocab - 1})", "tokens")
    return tokens
