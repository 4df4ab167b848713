"""The Responses request parser (``server/responses/request.py``), without a server: a body
becomes the typed request the chat path runs (a :class:`GenerationRequest` and chat messages),
and every refusal names the field as the client sent it, at construction (nothing renames it
afterwards)."""
from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from server.responses.request import parse
from server.tools.spec import NAMED

STORED = {"conversation": [{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Answer"}]}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
BODY = {"instructions": "Be brief.", "previous_response_id": "resp_1", "max_output_tokens": 9, "top_p": 0.5,
        "input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\": 1}"},
                  {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "1"}]},
                  {"type": "function_call_output", "call_id": "c2", "output": "2"}],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}}


def test_a_responses_body_becomes_the_typed_request_it_means():
    asked = []
    rr = parse(BODY, lambda rid: asked.append(rid) or STORED, 64)
    assert asked == ["resp_1"]
    calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": a}} for c, a in (("c1", {}),
                                                                                                   ("c2", {"a": 1}))]
    assert rr.messages == [  # as parse_messages gives a chat's: a call's arguments parsed
        {"role": "system", "content": "Be brief."}, *STORED["conversation"],
        {"role": "assistant", "content": "Let me", "tool_calls": calls},
        {"role": "tool", "content": "1", "tool_call_id": "c1"}, {"role": "tool", "content": "2", "tool_call_id": "c2"}]
    g = rr.generation
    assert (g.max_tokens, g.max_tokens_param, g.sampling.max_new_tokens, g.sampling.top_p) == \
        (9, "max_output_tokens", 9, 0.5)
    assert g.constraint.param == "text.format.schema" and g.constraint.schema is not None
    assert [t.name for t in g.tools.tools] == ["f"] and g.tools.tools[0].path == "tools[0]"
    assert (g.tools.choice, g.tools.name, g.tools.parallel) == (NAMED, "f", False)
    assert g.tools.tools[0].parameters == {"type": "object"} and g.tools.tools[0].strict
    # what a continuation of this one re-sends: the stored form, a call's arguments as text
    sent = [{"id": c, "type": "function", "function": {"name": "f", "arguments": a}}
            for c, a in (("c1", "{}"), ("c2", "{\"a\": 1}"))]
    assert rr.conversation == [*STORED["conversation"], {"role": "assistant", "content": "Let me", "tool_calls": sent},
                               {"role": "tool", "tool_call_id": "c1", "content": "1"},
                               {"role": "tool", "tool_call_id": "c2", "content": "2"}]
    assert [i["type"] for i in rr.input_items] == ["message", "function_call", "function_call",
                                                   "function_call_output", "function_call_output"]
    assert all(i["id"] for i in rr.input_items)
    # a malformed body is refused before the store is asked
    with pytest.raises(Exception, match="background"):
        parse({"input": "x", "previous_response_id": "resp_1", "background": True}, lambda rid: asked.append(rid), 64)
    assert asked == ["resp_1"]


def _refusal(body: dict, max_messages: int = 64, stored: dict = STORED) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        parse(body, lambda rid: stored, max_messages)
    return e.value


def _items(k: int, item: dict) -> list:
    return [*BODY["input"][:k], item]


@pytest.mark.parametrize("change,param,says", [
    ({"max_output_tokens": -1}, "max_output_tokens", "max_output_tokens must be in [0, 2147483647], got -1"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema",
     "text.format.schema must be a JSON Schema (an object)"),
    ({"text": {"format": {"type": "json_schema", "name": "a b"}}}, "text.format.name", "text.format.name must be"),
    ({"tools": [TOOL, {**TOOL, "name": "g"}, {**TOOL, "name": "a b"}]}, "tools[2].name", "tools[2].name must be"),
    ({"tools": [TOOL, TOOL]}, "tools[1].name", "tools[1].name 'f' is given twice"),
    ({"tools": [{**TOOL, "parameters": {"type": "array"}}]}, "tools[0].parameters",
     "tools[0].parameters must be a JSON Schema of an object"),
    ({"tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name", "names function 'g'"),
    ({"temperature": 3}, "temperature", "temperature must be in [0, 2], got 3"),
    ({"instructions": 5}, "instructions", "instructions must be a string"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "input[0].content must be"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image"}]}]},
     "input[0].content[1].type", "input[0].content[1] has type \"input_image\""),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0].text",
     "input[0].content[0].text must be a string"),
    ({"input": _items(2, {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "[1]"})},
     "input[2].arguments", "input[2].arguments must be a string holding a JSON object"),
    ({"input": _items(2, {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{"})},
     "input[2].arguments", "input[2].arguments must be a string holding a JSON object: "),
    ({"input": _items(3, {"type": "function_call_output", "call_id": "c9", "output": "1"})}, "input[3].call_id",
     "input[3].call_id 'c9' answers no tool call of an earlier assistant message"),
    ({"input": _items(4, {"type": "function_call_output", "call_id": "c2", "output": 2})}, "input[4].output",
     "input[4].output must be a string"),
])
def test_a_refusal_names_the_field_as_sent(change, param, says):
    e = _refusal({**BODY, **change})
    assert e.param == param and says in e.message, e
    assert not any(w in e.message for w in ("response_format", "max_tokens", "].function", "messages[")), e


def test_the_message_limit_counts_instructions_and_the_stored_conversation():
    """The server's message limit is the chat route's, counted over what the prompt renders; a
    stored message that is no message names ``previous_response_id``."""
    e = _refusal(BODY, max_messages=5)  # 1 + 2 + 3: the input's 5 items are 3 messages
    assert (e.param, e.message) == ("input", "messages holds 6 messages, more than this server's limit of 5")
    assert len(parse(BODY, lambda rid: STORED, 6).messages) == 6
    e = _refusal(BODY, stored={"conversation": [{"role": "robot", "content": "x"}]})
    assert e.param.startswith("previous_response_id"), e


def test_a_call_answered_by_an_earlier_turn_is_known():
    """A ``function_call_output`` may answer a call the stored conversation made."""
    stored = {"conversation": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
    rr = parse({"input": [{"type": "function_call_output", "call_id": "c0", "output": "1"}],
                "previous_response_id": "resp_1"}, lambda rid: stored, 64)
    assert rr.messages[1]["tool_calls"][0]["function"]["arguments"] == {} and rr.messages[-1]["tool_call_id"] == "c0"
    assert rr.conversation[-1] == {"role": "tool", "tool_call_id": "c0", "content": "1"}
