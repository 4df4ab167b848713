"""The Responses API (``/v1/responses``) against one real server (gunicorn with two workers, so
a continuation often lands on the other worker: the node's store is shared), with the real
clients: raw HTTP validated with jsonschema against OpenAI's document (every response, every
streamed event), the OpenAI SDK's ``client.responses``, the OpenAI Agents SDK's default
(Responses) model running an agent with a function tool to completion, and LangChain's
``use_responses_api``. Two tenants: isolation.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import jsonschema
import pytest

from tests.support.http import RESPONSES, error, open_stream, request
from tests.support.openai_document import DOC, conforms
from tests.support.responses import KEY, create
from tests.support.servers import running_server
from tests.support.tenants import write_tenants

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
_SCHEMAS = DOC["components"]["schemas"]
#: event type -> its component in OpenAI's document (ResponseStreamEvent is a union by ``type``)
EVENT_COMPONENT = {t: ref["$ref"].split("/")[-1] for ref in _SCHEMAS["ResponseStreamEvent"]["anyOf"]
                   for t in _SCHEMAS[ref["$ref"].split("/")[-1]]["properties"]["type"]["enum"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tenants(tmp_path_factory.mktemp("tenants") / "t.json",
                         [{"id": "a", "api_keys": ["key-a"]}, {"id": "b", "api_keys": ["key-b"]}])
    with running_server("--tenants", path, "--max-slots", "4", "--max-seq-len", "2048", "--max-queued", "8",
                        "--workers", "2", "--threads", "12") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0, timeout=120)


def stream(server, body: dict, key: str = KEY) -> list[dict]:
    """Every event of a streamed response, each validated as its component; sequence numbers
    count from 0; ``event:`` names the type."""
    status, headers, raw = request(server, "POST", RESPONSES, {**body, "stream": True}, key=key)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw[:500]
    events = []
    for block in raw.decode().split("\n\n"):
        lines = [x for x in block.split("\n") if x and not x.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        e = json.loads(lines[1][6:])
        assert e["type"] == lines[0][7:]
        conforms(EVENT_COMPONENT[e["type"]], e)
        events.append(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def text_of(r: dict) -> str:
    return "".join(c["text"] for item in r["output"] if item["type"] == "message" for c in item["content"])


# -- text ---------------------------------------------------------------------------------------------
def test_plain_and_streamed_answers_conform_and_agree(server, client):
    body = {"input": "Name three colours.", "instructions": "Answer briefly.", "max_output_tokens": 24,
            "temperature": 0, "metadata": {"k": "v"}}
    r = create(server, body)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["output_tokens"] == 24 and r["metadata"] == {"k": "v"} and r["instructions"] == "Answer briefly."
    events = stream(server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == text_of(r) == text_of(events[-1]["response"]) and deltas
    # the SDK: same greedy text, and its stream's events end with the whole response
    sdk = client.responses.create(model="local-model", input=body["input"], instructions=body["instructions"],
                                  max_output_tokens=24, temperature=0)
    assert sdk.output_text == text_of(r) and sdk.usage.input_tokens == r["usage"]["input_tokens"]
    sdk_events = list(client.responses.create(model="local-model", input=body["input"], stream=True,
                                              instructions=body["instructions"], max_output_tokens=24, temperature=0))
    streamed = "".join(e.delta for e in sdk_events if e.type == "response.output_text.delta")
    assert sdk_events[-1].type == "response.incomplete"
    assert streamed == sdk_events[-1].response.output_text == text_of(r)
    server.wait_idle()


def test_continuation_reuses_the_earlier_turns_kv_cells(server, client):
    first = client.responses.create(model="local-model", input="Tell me about the sea in two sentences.",
                                    max_output_tokens=40, temperature=0)
    second = client.responses.create(model="local-model", input="And about mountains?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=8)
    earlier = first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    print(f"\nturn 2: {second.usage.input_tokens} input tokens, {cached} cached; turn 1 was {earlier} tokens")
    # the earlier prompt and answer, re-sent, come from the prefix cache (but its last token,
    # which a new turn re-reads, and one token where the answer's end is tokenized anew)
    assert cached >= earlier - 2 and second.usage.input_tokens > earlier
    assert second.previous_response_id == first.id
    # the conversation is what was said: the stored input and output come first
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And about mountains?"]
    # the chat path's telemetry: the log line and the metrics, under the Responses route
    logged = [json.loads(line) for line in open(server.log) if line.startswith('{"request_id"')]
    mine = [r for r in logged if r["route"] == "/v1/responses" and r["tenant"] == "a"
            and r["prompt_tokens"] == second.usage.input_tokens and r["cached_tokens"] == cached]
    assert mine and mine[-1]["status"] == "200"
    metrics = request(server, "GET", "/metrics", key=KEY)[2].decode()
    assert 'route="/v1/responses"' in metrics and 'tenant="a"' in metrics


# -- function tools ------------------------------------------------------------------------------------
def test_function_call_then_its_output_in_a_second_turn(server, client):
    r = client.responses.create(model="local-model", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", temperature=0, max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    conforms("Response", r.model_dump(mode="json", exclude_unset=True))
    answer = client.responses.create(model="local-model", previous_response_id=r.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": json.dumps({"temperature_c": 21, "sky": "sunny"})}],
                                     temperature=0, max_output_tokens=24)
    assert answer.status in ("completed", "incomplete") and answer.output
    for o in answer.output:  # the small model may answer or call again; either is well-formed
        if o.type == "function_call" and o.status == "completed":  # not cut by max_output_tokens
            jsonschema.validate(json.loads(o.arguments), WEATHER["parameters"])
    # the same tools, so the same prompt up to the call: the first turn's cells are reused
    assert answer.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    # without the store: the whole conversation as items, as a stateless client sends it
    stateless = create(server, {"input": [{"role": "user", "content": "What is the weather in Paris?"},
                                          calls[0].model_dump(), {"type": "function_call_output",
                                                                  "call_id": calls[0].call_id, "output": "21 C"}],
                                "tools": [WEATHER], "tool_choice": "none", "store": False, "temperature": 0, "max_output_tokens": 12})
    assert text_of(stateless)
    error(request(server, "GET", f"/v1/responses/{stateless['id']}", key=KEY), 404, "response_id")


def test_a_response_whose_call_was_cut_can_be_continued(server):
    """A function call cut by ``max_output_tokens`` was stored with its
    partial arguments, and every continuation of the response was a 400 on them."""
    r = create(server, {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
                        "max_output_tokens": 20, "temperature": 0})
    (cut,) = [o for o in r["output"] if o["type"] == "function_call"]
    assert r["status"] == "incomplete" and cut["status"] == "incomplete"
    follow = create(server, {"previous_response_id": r["id"], "input": "Never mind; say hi.", "max_output_tokens": 8,
                             "temperature": 0})
    assert follow["status"] in ("completed", "incomplete") and follow["output"]
    # the cut call was never made, so nothing may answer it
    error(request(server, "POST", "/v1/responses", {"previous_response_id": r["id"], "tools": [WEATHER],
                                                 "input": [{"type": "function_call_output", "call_id": cut["call_id"],
                                                            "output": "21 C"}]}, key=KEY), 400, "input[0].call_id")


def test_streamed_function_call_events(server):
    events = stream(server, {"input": "Weather in Rome?", "tools": [WEATHER], "max_output_tokens": 60,
                             "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False})
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert done["arguments"] == args and done["name"] == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    item = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert item["type"] == "function_call" and item["arguments"] == args and item["status"] == "completed"
    assert events[-1]["response"]["output"] == [item]


# -- text.format -----------------------------------------------------------------------------------------
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "country": {"type": "string", "maxLength": 20}},
        "required": ["name", "country"], "additionalProperties": False}


def test_text_format_json_schema_and_json_object(server, client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = client.responses.create(model="local-model", input="Describe Paris as JSON.", max_output_tokens=80,
                                text={"format": fmt}, temperature=0)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"
    events = stream(server, {"input": "Describe Paris as JSON.", "max_output_tokens": 80, "text": {"format": fmt},
                             "temperature": 0})
    assert events[-1]["type"] == "response.completed" and text_of(events[-1]["response"]) == r.output_text
    assert events[-1]["response"]["text"]["format"] == fmt
    r = create(server, {"input": "A JSON object about Rome.", "max_output_tokens": 40,
                        "text": {"format": {"type": "json_object"}}})
    if r["status"] == "completed":
        assert isinstance(json.loads(text_of(r)), dict)


def test_text_format_with_tools_is_a_document_or_calls(server, client):
    """OpenAI allows function tools with a JSON ``text.format`` (the Agents SDK sends both for an
    agent with tools and an ``output_type``): the output is calls, or a message whose text is a
    document of the format."""
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    for prompt in ("Describe Paris as JSON.", "What is the weather in Paris?"):
        r = client.responses.create(model="local-model", input=prompt, tools=[WEATHER], text={"format": fmt},
                                    temperature=0, max_output_tokens=80)
        assert r.status == "completed", r.output
        calls = [o for o in r.output if o.type == "function_call"]
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
        if not calls:
            jsonschema.validate(json.loads(r.output_text), CITY)
        conforms("Response", r.model_dump(mode="json", exclude_unset=True, by_alias=True))


# -- the store ---------------------------------------------------------------------------------------------
def test_get_input_items_delete(server):
    r = create(server, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                                {"type": "input_text", "text": "there"}]},
                                  {"type": "message", "role": "assistant", "content": "Hello."},
                                  {"role": "user", "content": "Bye"}], "max_output_tokens": 4})
    status, _, raw = request(server, "GET", f"/v1/responses/{r['id']}", key=KEY)
    assert status == 200 and json.loads(raw) == r
    status, _, raw = request(server, "GET", f"/v1/responses/{r['id']}/input_items?order=asc&limit=2", key=KEY)
    items = json.loads(raw)
    conforms("ResponseItemList", items)
    assert [i["role"] for i in items["data"]] == ["user", "assistant"] and items["has_more"]
    rest = json.loads(request(server, "GET", f"/v1/responses/{r['id']}/input_items?order=asc&after={items['last_id']}",
                              key=KEY)[2])
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Bye"] and not rest["has_more"]
    # a decimal digit of another script is no limit (int() read "٣" as 3)
    error(request(server, "GET", f"/v1/responses/{r['id']}/input_items?limit=%D9%A3", key=KEY), 400, "limit")
    assert request(server, "DELETE", f"/v1/responses/{r['id']}", key=KEY)[0] == 200
    error(request(server, "GET", f"/v1/responses/{r['id']}", key=KEY), 404, "response_id")
    error(request(server, "DELETE", f"/v1/responses/{r['id']}", key=KEY), 404, "response_id")
    error(request(server, "POST", "/v1/responses", {"input": "x", "previous_response_id": r["id"]}, key=KEY), 404,
          "previous_response_id")


def test_another_tenants_response_is_unknown(server):
    r = create(server, {"input": "Secret of tenant a", "max_output_tokens": 2})
    unknown = "resp_" + "0" * 48
    for rid in (r["id"], unknown):
        for method, path in (("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"),
                             ("DELETE", f"/v1/responses/{rid}")):
            err = error(request(server, method, path, key="key-b"), 404, "response_id")
            assert err["message"] == f"No response found with id {rid!r}"
        error(request(server, "POST", "/v1/responses", {"input": "x", "previous_response_id": rid}, key="key-b"), 404,
              "previous_response_id")
    assert request(server, "GET", f"/v1/responses/{r['id']}", key=KEY)[0] == 200  # still there for its tenant


@pytest.mark.parametrize("extra,param", [
    ({"background": True}, "background"), ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"), ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"), ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"prompt": {"id": "p"}}, "prompt"), ({"colour": 1}, "colour"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"max_output_tokens": -1}, "max_output_tokens"), ({"temperature": 3}, "temperature"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": [{**WEATHER, "name": "a b"}]}, "tools[0].name"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input[0].call_id"),
    ({"instructions": "Be brief.", "tools": [WEATHER],
      "input": [{"role": "user", "content": "Weather?"}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                       "arguments": "nope"}]}, "input[1].arguments"),
    ({"previous_response_id": 7}, "previous_response_id"), ({"store": "yes"}, "store"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"), ({"model": "gpt-4o"}, "model"),
    ({"text": {"format": {"type": "json_schema", "name": "c", "schema": {"type": "object", "minProperties": "x"}}}},
     "text.format.schema")])
def test_refusals_name_the_field(server, extra, param):
    err = error(request(server, "POST", "/v1/responses", {"input": "Hi", **extra}, key=KEY),
                404 if param == "model" else 400, param)
    # The message names Responses fields too, and the same one as param.
    assert not re.search(r"response_format|\bmax_tokens\b|\]\.function\b|messages\[", err["message"]), err
    item = re.match(r"input\[\d+\]", param)  # an item's fault: the message names that item
    assert item is None or item.group(0) in err["message"], err


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": 5}, "max_tokens"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tools[0].function")])
def test_chat_fields_sent_to_responses_are_named_as_sent(server, extra, param):
    """The renaming of the chat path's refusals to Responses fields
    was applied to the Responses request's own refusals too, so ``max_tokens`` was refused as
    an unrecognized ``max_output_tokens``."""
    err = error(request(server, "POST", "/v1/responses", {"input": "Hi", **extra}, key=KEY), 400, param)
    assert param.split(".")[-1] in err["message"], err


# -- clients ------------------------------------------------------------------------------------------------
def test_agents_sdk_runs_an_agent_with_a_function_tool(server):
    import agents

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 C in {city}."

    import openai
    model = agents.OpenAIResponsesModel(model="local-model", openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="key-a", max_retries=0, timeout=120))
    # stop_on_first_tool: the tool's result is the final output. A further model turn with
    # tool_choice auto makes the 135M model call again, or ramble past max_tokens, which the SDK
    # reports as a failure (response.incomplete); that turn is test_function_call_then_its_output...
    agent = agents.Agent(name="weather", instructions="Use get_weather to answer.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert seen and result.final_output == f"It is sunny and 21 C in {seen[0]}."
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem"]
    assert result.last_response_id.startswith("resp_")


def test_langchain_on_the_responses_api(server):
    from langchain_openai import ChatOpenAI

    def llm(max_tokens: int):
        return ChatOpenAI(base_url=server.url + "/v1", api_key="key-a", model="local-model", use_responses_api=True,
                          temperature=0, max_tokens=max_tokens, max_retries=0)

    reply = llm(12).invoke("Say hello.")
    assert reply.text and reply.response_metadata["status"] == "incomplete"
    called = llm(60).bind_tools([WEATHER], tool_choice="required").invoke("What is the weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"


# -- failure mid-stream (last: the engine restarts) -------------------------------------------------------
def test_engine_failure_mid_stream_is_an_error_event(server):
    events = []
    with open_stream(server, RESPONSES, {"input": "Write a long story.", "max_output_tokens": 1500, "stream": True,
                                         "text": {"format": {"type": "text"}}}, key=KEY) as r:
        assert r.status == 200, r.read()[:500]
        buf = b""
        killed = False
        for line in r:
            buf += line
            if line == b"\n" and buf.strip():
                block = buf.decode().strip()
                buf = b""
                if block.startswith(":"):
                    continue
                e = json.loads(block.split("data: ", 1)[1])
                conforms(EVENT_COMPONENT[e["type"]], e)
                events.append(e)
                if e["type"] == "response.output_text.delta" and not killed:
                    os.kill(server.engine.t.control.engine_pid, signal.SIGKILL)
                    killed = True
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds[-5:]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert events[-2]["code"] == "engine_unavailable"
    end = time.monotonic() + 120
    while request(server, "GET", "/health", key=KEY)[0] != 200:
        assert time.monotonic() < end
        time.sleep(0.2)
