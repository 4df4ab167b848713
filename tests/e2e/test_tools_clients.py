"""Tool calling with the real clients (OpenAI SDK, LangChain, LiteLLM, gRPC) against one real
server on the bundled model (its template has no tool syntax: the generic format), and the
Hermes format through ``--chat-template``'s path (Qwen2.5's template) on the in-process app.
Every call's arguments must validate against its function's schema."""
from __future__ import annotations

import json
import os
import pathlib
import time

import grpc
import jsonschema
import pytest

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from tests.support.servers import running_server

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "Europe/Paris"]}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server():
    # --deterministic: tests compare a streamed answer with the same request's non-streamed one,
    # and the tools make the context longer than the 256 tokens up to which the default profile
    # gives the same greedy output whatever the thread count and the prefix cache (README "Same
    # output"; past them a lone decode's attention sums in as many chunks as it has threads).
    with running_server("--max-slots", "4", "--max-seq-len", "1024", "--max-queued", "16", "--workers", "1",
                        "--threads", "24", "--deterministic", grpc=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(tool_server):
    import openai
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def valid(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


def create(client, **kw):
    return client.chat.completions.create(model="local-model", messages=kw.pop("messages", ASK), tools=TOOLS,
                                          max_tokens=kw.pop("max_tokens", 80), temperature=kw.pop("temperature", 0),
                                          **kw)


def test_required_answers_with_valid_calls(client):
    r = create(client, tool_choice="required", max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        valid(call.function.name, call.function.arguments)


def test_a_named_function_is_called_once(client):
    """As instructor's default mode asks (no ``parallel_tool_calls``: the
    call was repeated until ``max_tokens``, and instructor raised on ``length``), and with
    parallel calls asked for."""
    for parallel in ({}, {"parallel_tool_calls": True}):
        r = create(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=64, **parallel)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
        valid("get_time", call.function.arguments)


@pytest.mark.parametrize("stop", ['"', "Paris"])  # a piece of the envelope; an argument's value
def test_stop_strings_end_the_visible_text_only(client, stop):
    """Found by a client-library helper: a stop string matched inside the generic format's
    envelope (``{"response": "``) or a call's arguments, which ended the answer in its first
    tokens or cut the arguments under ``finish_reason: "tool_calls"``. It ends what the client
    sees: the same answer as without it, cut before its first occurrence in ``content``."""
    for ask in (ASK, [{"role": "user", "content": "Say hello to me, please."}]):
        plain = create(client, messages=ask, max_tokens=40).choices[0]
        cut = create(client, messages=ask, max_tokens=40, stop=[stop]).choices[0]
        text = plain.message.content or ""
        if stop in text:
            assert cut.message.content == text[:text.index(stop)] and cut.finish_reason == "stop"
        else:
            assert cut.message.content == plain.message.content and cut.finish_reason == plain.finish_reason
        assert [c.function.arguments for c in cut.message.tool_calls or ()] == \
            [c.function.arguments for c in plain.message.tool_calls or ()]
    required = create(client, tool_choice="required", parallel_tool_calls=False, stop=[stop]).choices[0]
    (call,) = required.message.tool_calls
    assert required.finish_reason == "tool_calls"
    valid(call.function.name, call.function.arguments)


def test_parallel_calls_off_is_one_call(client):
    r = create(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=48, n=2)
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls"
        valid(call.function.name, call.function.arguments)


def test_auto_is_text_or_valid_calls_and_no_envelope_in_content(client):
    for seed, question in enumerate(["Say hello to me.", "What is the weather in Paris? Call get_weather."]):
        r = create(client, messages=[{"role": "user", "content": question}], temperature=0.7, seed=seed)
        message = r.choices[0].message
        for call in message.tool_calls or ():
            valid(call.function.name, call.function.arguments)
        if not message.tool_calls:
            assert message.content and '"response"' not in message.content
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_an_answer_cut_in_its_first_tokens_leaves_no_envelope_in_content(client, choice):
    """``max_tokens`` 1 to 5 left ``{"tool_calls":`` in ``content``.
    Under ``required`` there is no content; under ``auto`` only the envelope's ``response`` text."""
    for max_tokens in (1, 3, 5):
        r = create(client, tool_choice=choice, max_tokens=max_tokens)
        content = r.choices[0].message.content or ""
        streamed = create(client, tool_choice=choice, max_tokens=max_tokens, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content
        assert r.choices[0].finish_reason == "length" and "{" not in content and '"' not in content, r
        assert choice == "auto" or not content


def test_none_answers_in_text(client):
    r = create(client, tool_choice="none", max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def join_stream(stream) -> tuple[str, list[list[str]], str]:
    """Content, calls ([id, name, arguments]) and finish reason from streamed chunks, checking
    OpenAI's delta rules: every entry has an index; a call's first carries id, type and name,
    later ones arguments only."""
    content, calls, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            assert d.index is not None
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append([d.id, d.function.name, d.function.arguments or ""])
            else:
                assert d.index < len(calls) and d.function.name is None and d.type is None
                calls[d.index][2] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_joined_stream_is_the_non_streamed_answer(client, choice):
    whole = create(client, tool_choice=choice, seed=5)
    content, calls, finish = join_stream(create(client, tool_choice=choice, seed=5, stream=True))
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert (content or None) == whole.choices[0].message.content
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments)
                                            for c in whole.choices[0].message.tool_calls]
    for _, name, arguments in calls:
        valid(name, arguments)
    # The SDK's stream helper builds the same message: content null, not ""
    with client.chat.completions.stream(model="local-model", messages=ASK, tools=TOOLS, tool_choice=choice,
                                        max_tokens=80, temperature=0, seed=5) as stream:
        final = stream.get_final_completion().choices[0].message
    assert final.content is None and [c.function.arguments for c in final.tool_calls] == [a for _, _, a in calls]


def test_a_second_turn_with_tool_results(client):
    first = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'}]
    r = create(client, messages=history, tool_choice="none", max_tokens=12)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # LiteLLM up to 1.80 sends the answer back with a record of its own (a 400)
    history[1] = {**history[1], "provider_specific_fields": {"refusal": None}}
    again = create(client, messages=history, tool_choice="none", max_tokens=12)
    assert again.choices[0].message.content == r.choices[0].message.content


def test_refusals_name_the_field(client):
    import openai
    cases = [(dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
             (dict(messages=ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "21"}]),
              "messages[1].tool_call_id"),
             (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
             (dict(messages=ASK + [{"role": "assistant", "content": "Sure, "}]), "continue_final_message"),
             (dict(extra_body={"structured_outputs": {"regex": "[a-z]+"}}), "structured_outputs.regex")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="local-model", messages=kw.pop("messages", ASK),
                                           tools=kw.pop("tools", TOOLS), max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string",
                                                                                     "maxLength": 30}},
        "required": ["city", "country"], "additionalProperties": False}


def test_tools_with_a_json_format_answer_with_calls_or_a_document(client):
    """OpenAI allows tools with ``response_format``: an answer is calls, or content that is a
    document of the format (what the Agents SDK sends for an agent with tools and an
    ``output_type``). Streamed and not, the same answer."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    kinds = set()
    for seed, question in enumerate(["Name the capital of France, as JSON.", "What is the weather in Paris?",
                                     "Which city is the Eiffel Tower in?", "Call get_time for UTC."]):
        messages = [{"role": "user", "content": question}]
        whole = create(client, messages=messages, response_format=fmt, temperature=0.8, seed=seed, max_tokens=60)
        content, calls, finish = join_stream(create(client, messages=messages, response_format=fmt, temperature=0.8,
                                                    seed=seed, max_tokens=60, stream=True))
        message = whole.choices[0].message
        assert (content or None) == message.content and finish == whole.choices[0].finish_reason
        assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments)
                                                for c in message.tool_calls or ()]
        if message.tool_calls:
            kinds.add("calls")
            assert finish == "tool_calls" and message.content is None
            for call in message.tool_calls:
                valid(call.function.name, call.function.arguments)
        elif finish == "stop":
            kinds.add("document")
            jsonschema.validate(json.loads(message.content), CITY)
        else:
            assert finish == "length" and '"response"' not in message.content
    assert kinds  # at least one answer ended (a call or a whole document)


def test_langchain_bind_tools_invoke_and_stream(tool_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: str) -> str:
        """Local time in a time zone (UTC or Europe/Paris)."""
        return "12:00"

    llm = ChatOpenAI(base_url=tool_server.url + "/v1", api_key="none", model="local-model", temperature=0,
                     max_tokens=40, max_retries=0)
    bound = llm.bind_tools([get_time], tool_choice="get_time", parallel_tool_calls=False)
    message = bound.invoke("What time is it in Paris?")
    assert message.tool_calls and all(c["name"] == "get_time" for c in message.tool_calls)
    assert all(isinstance(c["args"].get("zone"), str) for c in message.tool_calls)
    merged = None
    for chunk in bound.stream("What time is it in Paris?"):
        merged = chunk if merged is None else merged + chunk  # merges tool_call_chunks by index
    assert [c["name"] for c in merged.tool_calls] == [c["name"] for c in message.tool_calls]
    assert [c["args"] for c in merged.tool_calls] == [c["args"] for c in message.tool_calls]


def test_litellm_with_tools(tool_server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch
    import litellm

    r = litellm.completion(model="openai/local-model", api_base=tool_server.url + "/v1", api_key="none",
                           messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           max_tokens=60, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for c in calls:
        valid(c.function.name, c.function.arguments)


# -- gRPC --------------------------------------------------------------------------------------------
def grpc_tools() -> list[pb.Tool]:
    return [pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                    parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]


def test_grpc_tool_calls_unary_and_streamed(tool_server):
    channel = grpc.insecure_channel(f"127.0.0.1:{tool_server.grpc_port}")
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])], max_tokens=80,
                             temperature=0, tools=grpc_tools(), tool_choice=pb.ToolChoice(function="get_weather"),
                             parallel_tool_calls=False)
    for _ in range(100):  # the sidecar may still be starting
        try:
            response = stub.ChatComplete(request, timeout=120)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.2)
    (choice,) = response.choices
    (call,) = choice.tool_calls
    assert choice.finish_reason == "tool_calls" and call.name == "get_weather" and call.id.startswith("call_")
    valid("get_weather", call.arguments)
    calls = []
    for chunk in stub.ChatCompleteStream(request, timeout=120):
        for d in chunk.tool_calls:
            if d.id:
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    assert calls == [[call.name, call.arguments]]
    bad = pb.ChatRequest(messages=request.messages, tools=grpc_tools(), tool_choice=pb.ToolChoice(function="nope"))
    with pytest.raises(grpc.RpcError) as e:
        stub.ChatComplete(bad, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(e.value.trailing_metadata())["param"] == "tool_choice.function.name"
    channel.close()


def test_the_log_line_counts_calls_and_holds_no_arguments(client, tool_server):
    marker = {"type": "object", "properties": {"code": {"type": "string", "enum": ["zq7x3kw"]}},
              "required": ["code"], "additionalProperties": False}
    r = client.chat.completions.with_raw_response.create(
        model="local-model", messages=ASK, max_tokens=40, temperature=0, parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "send_code", "parameters": marker}}], tool_choice="required")
    assert json.loads(r.parse().choices[0].message.tool_calls[0].function.arguments) == {"code": "zq7x3kw"}
    request_id = r.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while True:
        lines = {(line := json.loads(s))["request_id"]: line for s in open(tool_server.log) if s.startswith("{")}
        if request_id in lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert lines[request_id]["tool_calls"] == 1 and lines[request_id]["finish_reason"] == "tool_calls"
    assert "zq7x3kw" not in open(tool_server.log).read()


# -- the Hermes format (Qwen2.5's template) on the in-process app ----------------------------------
def test_hermes_template_calls_are_read_out_of_the_text(app, tokenizer):
    from server.generation.pipeline import Generator
    from server.text.chat_template import ChatTemplate
    from tests.support.servers import AppServer

    source = (pathlib.Path(__file__).parents[1] / "server" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    hermes = AppServer(app.config, Generator(app.engine, tokenizer, ChatTemplate(tokenizer, source)))
    assert hermes.generator.tool_format.name == "hermes"
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 48, "temperature": 0}
    status, _, raw = hermes.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                    {"Content-Type": "application/json"})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        valid(call["function"]["name"], call["function"]["arguments"])
    hermes.wait_idle()
