"""The second model family end to end: real servers (gunicorn + engine + sidecar) on Gemma 3 270M
(``gemma-3-270m-q4_k_m.gguf``: a base model whose GGUF has no chat template, a 262,144-token
vocabulary, interleaved sliding-window attention).

Without a template the server starts and serves what needs none (completions, scoring,
``/infer`` and gRPC ``Infer`` as plain prompts, the tokenizer routes) and refuses every chat
with a 400 that says how to give one; ``/v1/models`` and the start-up log say so. With
``--chat-template`` (Gemma 2's turn format, which Gemma 3 shares) chat works, with a system
message (the template has no system role: it is merged into the user's turn), structured
outputs (with the separators measured best for this model, ``--json-separators``: no space after
a key), tools in the generic format (the template renders no tools), the prefix cache and a
preemption for KV memory. Both servers start together, once for the module.
"""
from __future__ import annotations

import concurrent.futures
import json

import grpc
import jsonschema
import pytest

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from tests.support.grpc_channel import open_channel, wait_serving
from tests.support.http import CHAT, COMPLETIONS, MODEL, RESPONSES, chat_body, error, get, ok, post
from tests.support.model import GEMMA_SEPARATORS, GEMMA_TEMPLATE, gemma_path
from tests.support.servers import RunningServer

#: ``general.name`` of the GGUF ("Gemma 3 270m"), made an id.
GEMMA_ID = "Gemma-3-270m"
GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": CITY}}
#: Room for two sequences of 120 prompt tokens, not for both to grow 20 tokens more.
KV_CELLS = 256


@pytest.fixture(scope="module")
def servers():
    """``(base, chat)``: the model as its file is (with the gRPC sidecar), and with
    ``--chat-template``, its JSON separators and a KV budget two growing sequences outgrow;
    started together."""
    flags = ("--model", gemma_path(), "--workers", "1", "--max-slots", "2", "--max-seq-len", str(KV_CELLS))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(RunningServer, *flags, grpc=True),
                  pool.submit(RunningServer, *flags, "--chat-template", GEMMA_TEMPLATE,
                              "--kv-cache-tokens", str(KV_CELLS), "--json-separators", GEMMA_SEPARATORS)]
    try:
        yield tuple(s.result() for s in starts)
    finally:
        for s in starts:
            if s.exception() is None:
                s.result().stop()


@pytest.fixture(scope="module")
def base(servers):
    return servers[0]


@pytest.fixture(scope="module")
def chat(servers):
    return servers[1]


# -- without a chat template ---------------------------------------------------------------------------
def test_the_model_is_named_by_its_file_and_says_it_serves_no_chat(base, chat):
    listed = ok(get(base, "/v1/models"))["data"]
    assert [m["id"] for m in listed] == [GEMMA_ID, MODEL]
    assert all(m["capabilities"] == ["completion"] for m in listed)
    assert ok(get(chat, f"/v1/models/{GEMMA_ID}"))["capabilities"] == ["completion", "chat"]
    with open(base.log) as f:
        log = f.read()
    assert f"served as {GEMMA_ID}, {MODEL}; chat: no, the model has no chat template" in log, log[-2000:]
    assert "--chat-template FILE" in log and "Traceback" not in log
    with open(chat.log) as f:  # the other says what it lays JSON out with, where not the default
        assert f'chat: yes (chat template: --chat-template {GEMMA_TEMPLATE}); JSON separators [", ", ":"]' in f.read()


def test_completions_and_scoring_serve_without_a_template(base):
    r = ok(post(base, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 4, **GREEDY}))
    assert r["model"] == GEMMA_ID and r["usage"]["completion_tokens"] == 4 and r["choices"][0]["text"]
    assert ok(post(base, COMPLETIONS, {"model": MODEL, "prompt": "Hi", "max_tokens": 1}))["model"] == MODEL
    scored = ok(post(base, COMPLETIONS, {"model": GEMMA_ID, "prompt": "The sea is blue", "max_tokens": 0,
                                         "echo": True, "logprobs": 1}))
    assert scored["model"] == GEMMA_ID
    logprobs = scored["choices"][0]["logprobs"]
    assert logprobs["tokens"][0] == "<bos>" and logprobs["token_logprobs"][0] is None  # Gemma's BOS, unscored
    assert all(lp < 0 for lp in logprobs["token_logprobs"][1:])


def test_infer_continues_its_payload_as_a_prompt(base):
    r = ok(post(base, "/infer", {"payload": "Once upon a time", "max_new_tokens": 5}))
    assert r["tokens"] == 5 and r["text"] and r["finish_reason"] == "length"
    prompted = ok(post(base, COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 5, **GREEDY}))
    assert r["text"] == prompted["choices"][0]["text"]  # /infer is greedy: the same continuation


def test_grpc_infer_serves_and_grpc_chat_is_refused(base):
    channel = open_channel(base.grpc_port)
    try:
        wait_serving(channel)
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        assert stub.Infer(pb.InferRequest(payload="Once upon a time", max_new_tokens=3), timeout=60).tokens == 3
        with pytest.raises(grpc.RpcError) as e:
            stub.ChatComplete(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")], max_tokens=2),
                              timeout=60)
    finally:
        channel.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(e.value.trailing_metadata())["code"] == "chat_template_missing"
    assert "--chat-template" in e.value.details()


def test_tokenizer_routes_serve_a_prompt_and_refuse_a_chat(base):
    tokens = ok(post(base, "/tokenize", {"prompt": "Hello world"}))["tokens"]
    assert tokens[0] == 2 and ok(post(base, "/detokenize", {"tokens": tokens}))["prompt"] == "<bos>Hello world"
    info = ok(get(base, "/tokenizer_info"))
    assert info["vocab_size"] == 262144 and info["chat_template"] is None
    error(post(base, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}), 400, param="messages",
          code="chat_template_missing")


@pytest.mark.parametrize("path, body, param", [
    (CHAT, chat_body("Hi", max_tokens=2), "messages"),
    (CHAT, chat_body("Hi", max_tokens=2, stream=True), "messages"),  # refused before the stream starts
    (CHAT, chat_body("Hi", tools=[WEATHER]), "messages"),
    (CHAT, chat_body("Hi", response_format={"type": "json_object"}), "messages"),
    (CHAT, chat_body("Hi", temperature=7), "messages"),  # before any field is read
    (RESPONSES, {"input": "Hi", "max_output_tokens": 2}, "input"),
    (RESPONSES, {"input": "Hi", "previous_response_id": "resp_none"}, "input"),
])
def test_every_chat_gets_a_400_that_says_how_to_give_a_template(base, path, body, param):
    err = error(post(base, path, body), 400, param=param, code="chat_template_missing")
    assert "no chat template" in err["message"] and "--chat-template FILE" in err["message"]


# -- with --chat-template ------------------------------------------------------------------------------
def test_chat_with_a_system_message(chat):
    """Gemma's template has no system role; the system text is merged into the user's turn, as
    llama-server does, where the template alone would refuse the conversation."""
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"}]
    r = ok(post(chat, CHAT, {"messages": messages, "max_tokens": 4, **GREEDY}))
    assert r["model"] == GEMMA_ID and r["usage"]["completion_tokens"] >= 1
    rendered = ok(post(chat, "/tokenize", {"messages": messages, "add_generation_prompt": True,
                                           "return_token_strs": True}))
    text = "".join(rendered["token_strs"])
    assert text == "<bos><start_of_turn>user\nAnswer in one word.\nHi<end_of_turn>\n<start_of_turn>model\n", text
    assert r["usage"]["prompt_tokens"] == rendered["count"]


def test_a_json_schema_answer_is_valid_json_of_the_schema_with_the_model_separators(chat):
    r = ok(post(chat, CHAT, chat_body("Which city is the Eiffel Tower in? Reply in JSON.", max_tokens=40, **GREEDY,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "city", "strict": True,
                                                                       "schema": CITY}})))
    assert r["choices"][0]["finish_reason"] == "stop", r
    content = r["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), CITY)
    assert content.startswith('{"city":"'), content  # no space after the key: --json-separators


def test_a_required_tool_call_in_the_generic_format(chat):
    r = ok(post(chat, CHAT, chat_body("What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=60, **GREEDY)))
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", r
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    assert call["function"]["arguments"].startswith('{"city": "'), call  # calls as the templates show them


def test_a_repeated_prompt_hits_the_prefix_cache(chat):
    prompt = " ".join(f"Line {i}: the tide comes in and goes out." for i in range(8))
    first = ok(post(chat, COMPLETIONS, {"prompt": prompt, "max_tokens": 1, **GREEDY}))
    again = ok(post(chat, COMPLETIONS, {"prompt": prompt, "max_tokens": 1, **GREEDY}))
    assert first["usage"]["prompt_tokens"] > 64
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_sequences_that_outgrow_the_kv_budget_are_preempted_and_finish(chat):
    """Two prompts of 120 tokens fit the 256 cells together; growing 20 tokens each they do not,
    so the younger is preempted, waits, resumes, and both end whole."""
    chat.wait_idle()
    before = chat.engine.snapshot().preemptions
    prompts = [[2] + list(range(10_000 + 500 * i, 10_000 + 500 * i + 119)) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda p: ok(post(chat, COMPLETIONS, {"prompt": p, "max_tokens": 20, "ignore_eos": True,
                                                                      **GREEDY})), prompts))
    assert chat.engine.snapshot().preemptions > before
    assert [r["usage"]["completion_tokens"] for r in replies] == [20, 20]
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    chat.wait_idle()
