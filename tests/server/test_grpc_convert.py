"""gRPC request messages -> typed requests (``server/grpc/convert.py``), without a server: the
same requests and the same refusals, named as the chat body names the field, as
``/v1/chat/completions`` and ``/infer``."""
from __future__ import annotations

import json

import pytest

from engine.errors import InvalidRequest
from engine.request import Priority
from proto import inference_pb2 as pb
from server.generation.request import EmbeddingRequest
from server.api.errors import PermissionDenied
from server.api.requests import parse_generation, parse_messages
from server.grpc.convert import chat_request, embed_request, infer_request, model_field
from server.tenancy.tenants import DEFAULT_TENANT, Tenant, TenantRegistry, Tenants

WEATHER = '{"type": "object", "properties": {"city": {"type": "string"}}}'


def chat(**fields) -> pb.ChatRequest:
    return pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")], **fields)


def test_a_chat_message_becomes_the_request_its_json_body_is():
    message = chat(model="alias", max_tokens=5, temperature=0.5, stop=["x"], n=2, priority=pb.PRIORITY_LOW,
                   logit_bias={7: -100.0}, tools=[pb.Tool(name="w", parameters=WEATHER, strict=True)],
                   tool_choice=pb.ToolChoice(function="w"), parallel_tool_calls=False,
                   response_format=pb.ResponseFormat(type="json_object", schema='{"type": "object"}'))
    message.messages.extend([pb.ChatMessage(role="assistant", content="", tool_calls=[
        pb.ToolCall(id="c1", name="w", arguments='{"city": "Oslo"}')]), pb.ChatMessage(role="tool", content="3",
                                                                                      tool_call_id="c1")])
    greq, messages, render = chat_request(message, 8)
    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "", "tool_calls": [{
                             "id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
                         {"role": "tool", "content": "3", "tool_call_id": "c1"}],
            "max_tokens": 5, "temperature": 0.5, "stop": ["x"], "n": 2, "priority": "low", "logit_bias": {"7": -100},
            "tools": [{"type": "function", "function": {"name": "w", "parameters": json.loads(WEATHER),
                                                        "strict": True}}],
            "tool_choice": {"type": "function", "function": {"name": "w"}}, "parallel_tool_calls": False,
            "response_format": {"type": "json_object", "schema": {"type": "object"}}}
    assert model_field(message) == {"model": "alias"}
    assert greq == parse_generation(body, chat=True) and greq.priority == Priority.LOW
    assert messages == parse_messages(body, 8)
    assert render == {"add_generation_prompt": True, "continue_final_message": False}
    assert model_field(chat()) == {}  # empty: the default model


@pytest.mark.parametrize("fields,param,says", [
    ({"tools": [pb.Tool(name="w", parameters="{")]}, "tools[0].function.parameters",
     "parameters must be a JSON Schema as JSON text"),
    ({"tools": [pb.Tool(name="w", parameters='{"type": "array"}')]}, "tools[0].function.parameters",
     "tools[0].function.parameters must be a JSON Schema of an object"),
    ({"tools": [pb.Tool(name="w"), pb.Tool(name="a b")]}, "tools[1].function.name", "tools[1].function.name must be"),
    ({"tools": [pb.Tool(name="w")], "tool_choice": pb.ToolChoice(function="v")}, "tool_choice.function.name",
     "tool_choice names function 'v'"),
    ({"tool_choice": pb.ToolChoice(mode="sometimes")}, "tool_choice", "tool_choice must be none, auto, required"),
    ({"response_format": pb.ResponseFormat(type="json_schema", json_schema=pb.JsonSchema(name="x", schema="{"))},
     "response_format.json_schema.schema", "response_format.json_schema.schema is not JSON"),
    ({"response_format": pb.ResponseFormat(type="")}, "response_format.type", "response_format.type must be"),
    ({"temperature": 3}, "temperature", "temperature must be in [0, 2], got 3.0"),
    ({"priority": 9}, "priority", "priority must be one of PRIORITY_UNSPECIFIED"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", 'logit_bias keys must be token ids'),
])
def test_a_refusal_names_the_chat_field(fields, param, says):
    with pytest.raises(InvalidRequest) as e:
        chat_request(chat(**fields), 8)
    assert e.value.param == param and says in e.value.message, e.value


@pytest.mark.parametrize("messages,param,says", [
    ([pb.ChatMessage(role="robot", content="x")], "messages[0].role", 'messages[0].role must be one of'),
    ([pb.ChatMessage(role="tool", content="x")], "messages[0].tool_call_id", "must be a string"),
    ([pb.ChatMessage(role="tool", content="x", tool_call_id="c9")], "messages[0].tool_call_id",
     "messages[0].tool_call_id 'c9' answers no tool call of an earlier assistant message"),
    ([pb.ChatMessage(role="user", content="x", tool_call_id="c9")], "messages[0].tool_call_id",
     "is only allowed on tool messages"),
    ([pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(id="c", name="f", arguments="{}")])],
     "messages[0].tool_calls", "is only allowed on assistant messages"),
    ([pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments="[]")])],
     "messages[0].tool_calls[0].function.arguments", "must be a string holding a JSON object"),
    ([], "messages", "messages must be a non-empty array"),
    ([pb.ChatMessage(role="user", content="x")] * 9, "messages", "more than this server's limit of 8"),
])
def test_a_message_refusal_names_the_message(messages, param, says):
    with pytest.raises(InvalidRequest) as e:
        chat_request(pb.ChatRequest(messages=messages), 8)
    assert e.value.param == param and says in e.value.message, e.value


def test_an_infer_message_is_the_infer_body():
    open_registry = TenantRegistry(Tenants([]))
    message = pb.InferRequest(payload="", max_new_tokens=3, priority=pb.PRIORITY_HIGH)
    tenant_id, greq, payload = infer_request(message, DEFAULT_TENANT, open_registry)
    assert (tenant_id, payload) == (DEFAULT_TENANT.id, "")
    assert (greq.sampling.max_new_tokens, greq.priority, greq.max_tokens_param) == (3, Priority.HIGH, "max_new_tokens")
    with pytest.raises(InvalidRequest) as e:
        infer_request(pb.InferRequest(payload="x", max_new_tokens=0), DEFAULT_TENANT, open_registry)
    assert e.value.param == "max_new_tokens"
    assert infer_request(pb.InferRequest(payload="x", tenant_id="t"), DEFAULT_TENANT, open_registry)[0] == "t"
    acme = Tenant("acme", 1)
    closed = TenantRegistry(Tenants([(acme, ["acme-key"])]))
    with pytest.raises(PermissionDenied) as e:
        infer_request(pb.InferRequest(payload="x", tenant_id="other"), acme, closed)
    assert e.value.param == "tenant_id"


def test_an_embed_message_is_the_embeddings_body():
    """Strings or token-id arrays, as ``/v1/embeddings``'s ``input``; both at once is refused."""
    assert embed_request(pb.EmbedRequest(input=["a", "b"], dimensions=4, priority=pb.PRIORITY_HIGH)) == \
        EmbeddingRequest(("a", "b"), dimensions=4, priority=Priority.HIGH)
    assert embed_request(pb.EmbedRequest(input_ids=[pb.TokenIds(ids=[1, 2]), pb.TokenIds(ids=[3])],
                                         truncate_prompt_tokens=-1)) == EmbeddingRequest(((1, 2), (3,)), truncate=-1)
    for message, param in ((pb.EmbedRequest(input=["a"], input_ids=[pb.TokenIds(ids=[1])]), "input_ids"),
                           (pb.EmbedRequest(), "input"), (pb.EmbedRequest(input=[""]), "input[0]")):
        with pytest.raises(InvalidRequest) as e:
            embed_request(message)
        assert e.value.param == param, e.value
