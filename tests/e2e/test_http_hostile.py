"""Hostile input found by an attack run: each once gave a 5xx, a dead engine or a busy loop."""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from tests.support.http import CHAT, assert_error_shape, post

HI = [{"role": "user", "content": "Write a sentence about the sea."}]


@pytest.mark.parametrize("penalty", [{"presence_penalty": 0.5}, {"frequency_penalty": 1.0},
                                     {"repeat_penalty": 1.3}])
def test_penalties_work_and_change_greedy_text(server, penalty):
    base = {"messages": HI, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, _, plain = post(server, CHAT, base).parsed()
    assert status == 200
    status, _, penalized = post(server, CHAT, {**base, **penalty}).parsed()
    assert status == 200, penalized
    assert penalized["usage"]["completion_tokens"] == 24
    if "repeat_penalty" in penalty:
        assert penalized["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]
    server.wait_idle()
    assert server.engine.ready()


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "seed", "n", "top_k", "deadline_ms"])
def test_integers_too_big_for_a_float_are_400(server, field):
    raw = '{"messages": [{"role": "user", "content": "hi"}], "%s": 1%s}' % (field, "0" * 400)
    status, _, body = post(server, CHAT, raw.encode()).parsed()
    assert status == 400
    assert assert_error_shape(body)["param"] == field


@pytest.mark.parametrize("path,body", [
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", '{"prompt": "a\\udc00b"}'),
    ("/infer", '{"payload": "hi", "tenant_id": "\\ud800", "max_new_tokens": 2}'),
])
def test_unpaired_surrogate_escapes_are_400(server, path, body):
    status, _, reply = post(server, path, body.encode()).parsed()
    assert status == 400 and "surrogate" in assert_error_shape(reply)["message"]


@pytest.mark.parametrize("raw", [
    '{"prompt": "hi", "max_tokens": 1, "temperature": NaN}',
    '{"prompt": "hi", "max_tokens": 1, "top_p": Infinity}',
    '{"prompt": "hi", "max_tokens": 1, "presence_penalty": -Infinity}',
    '{"prompt": "hi", "max_tokens": 1, "frequency_penalty": 1e999}',
    '{"prompt": "hi", "max_tokens": 1, "response_format": {"type": "json_schema", "json_schema": '
    '{"name": "n", "schema": {"type": "number", "maximum": NaN}}}}',
])
def test_numbers_json_does_not_have_are_400(server, raw):
    """ujson reads ``NaN``, ``Infinity`` and ``1e999`` (as infinity); JSON has none of them."""
    status, _, reply = post(server, "/v1/completions", raw.encode()).parsed()
    assert status == 400 and "not valid JSON" in assert_error_shape(reply)["message"], reply


def test_a_body_nested_as_deep_as_ujson_reads_with_a_suspect_number_is_a_400_not_a_crash(server):
    """1,000 levels (ujson reads up to 1,023) holding ``1e100``: neither look (non-finite
    numbers, nesting) may recurse (Python's limit is 1,000: a RecursionError was a 500)."""
    raw = '{"prompt": "hi", "max_tokens": 1, "stop": ' + "[" * 1000 + "1e100" + "]" * 1000 + "}"
    status, _, reply = post(server, "/v1/completions", raw.encode()).parsed()
    assert status == 400 and "nest more than 128 levels" in assert_error_shape(reply)["message"], reply


def _nested_object(levels: int) -> dict:
    """A JSON Schema whose properties nest ``levels`` objects deep (each level two JSON levels)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_json_nested_deeper_than_128_levels_is_a_400_wherever_it_is(server):
    """Tool parameters, a JSON format's schema and a history call's arguments 300 levels deep
    (within ujson's 1,023) were 500s: ``json.dumps`` of the schema, or the template's rendering of
    the arguments, recursed past Python's limit. Each is a 400 naming what holds it."""
    deep = _nested_object(150)
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    status, _, reply = post(server, CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                           "max_tokens": 2}).parsed()
    assert status == 400 and "nest more than 128 levels" in assert_error_shape(reply)["message"], reply
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": json.dumps(deep)}}
    status, _, reply = post(server, CHAT, {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt,
                                           "max_tokens": 2}).parsed()
    assert status == 400, reply
    arguments = '{"a": ' * 300 + "1" + "}" * 300
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    status, _, reply = post(server, CHAT, {"messages": messages, "max_tokens": 2}).parsed()
    assert status == 400 and assert_error_shape(reply)["param"] == "messages[1].tool_calls[0].function.arguments"
    # brackets inside strings (escaped quotes among them) are text, not nesting
    prompt = '\\"[{' * 150
    status, _, reply = post(server, "/v1/completions",
                            {"prompt": prompt, "max_tokens": 1, "stop": ['"]' * 200]}).parsed()
    assert status == 200, reply
    # 128 levels are JSON this server reads: the field's own check answers (a list of lists is no stop)
    raw = '{"prompt": "hi", "max_tokens": 1, "stop": ' + "[" * 127 + '"x"' + "]" * 127 + "}"
    status, _, reply = post(server, "/v1/completions", raw.encode()).parsed()
    assert status == 400 and assert_error_shape(reply)["param"] == "stop", reply


@pytest.mark.parametrize("arguments,reason", [
    ('{"a": NaN}', "NaN"),
    ('{"a": "\\ud800"}', "surrogate"),  # a lone surrogate in the JSON text inside the body was a 500
    ('{"\\udfff x": 1}', "surrogate"),
])
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_tool_call_arguments_json_does_not_have_are_400(server, path, arguments, reason):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    status, _, reply = post(server, path,
                            {"messages": messages, **({"max_tokens": 2} if path == CHAT else {})}).parsed()
    error = assert_error_shape(reply)
    assert status == 400 and error["param"] == "messages[1].tool_calls[0].function.arguments", reply
    assert reason in error["message"]
    paired = '{"a": "\\ud83d\\ude00"}'  # a pair is one character, an emoji
    messages[1]["tool_calls"][0]["function"]["arguments"] = paired
    assert post(server, path, {"messages": messages, **({"max_tokens": 2} if path == CHAT else {})})[0] == 200


def test_a_responses_call_item_with_a_lone_surrogate_in_its_arguments_is_a_400(server):
    items = [{"role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": "\\ud800"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    status, _, reply = post(server, "/v1/responses", {"input": items, "max_output_tokens": 2}).parsed()
    assert status == 400 and "surrogate" in assert_error_shape(reply)["message"], reply


def test_the_words_nan_and_infinity_in_text_are_text(server):
    status, _, reply = post(server, "/v1/completions", json.dumps(
        {"prompt": "NaN, Infinity and 1e999 are not JSON numbers", "max_tokens": 1, "temperature": 0.5,
         "stop": ["NaN"]}).encode()).parsed()
    assert status == 200, reply


def test_paired_surrogate_escape_is_an_emoji(server):
    status, _, reply = post(server, "/v1/completions", {"prompt": "\U0001F600", "max_tokens": 1}).parsed()
    assert status == 200, reply


def test_malformed_chunked_body_is_400(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert_error_shape(json.loads(payload))


def test_n_beyond_capacity_is_400_not_503(single):
    status, _, body = post(single, CHAT, {"messages": HI, "n": 3, "max_tokens": 2}).parsed()
    assert status == 400 and assert_error_shape(body)["param"] == "n"


@pytest.mark.parametrize("body,param", [
    ({"messages": HI, "max_tokens": "bad", "max_completion_tokens": 4}, "max_tokens"),
    ({"messages": HI, "model": 123}, "model"),
])
def test_more_invalid_fields(server, body, param):
    status, _, reply = post(server, CHAT, body).parsed()
    assert status == 400 and assert_error_shape(reply)["param"] == param


@pytest.mark.parametrize("extra", [{"best_of": 2}, {"suffix": "end"}])
def test_unsupported_legacy_options_are_refused(server, extra):
    status, _, reply = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **extra}).parsed()
    assert status == 400 and assert_error_shape(reply)["param"] == next(iter(extra))


def test_hang_up_after_pipelining_cancels(server):
    """A client pipelines a second request, then closes: its running request is cancelled
    within a step or two (EOF hides behind the pipelined bytes; the hang-up does not)."""
    body = json.dumps({"messages": HI, "max_tokens": 200, "ignore_eos": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request)
        deadline = time.monotonic() + 30
        while all(m == -1 for m in server.engine.slot_mailboxes()):  # until the first one runs
            assert time.monotonic() < deadline
            time.sleep(0.005)
        s.sendall(request)
    at_close = server.engine.step()
    server.wait_idle(timeout=60)
    assert server.engine.step() - at_close <= 3
    status, _, reply = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).parsed()
    assert status == 200


def test_seeded_choices_differ_but_repeat(server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "n": 3, "temperature": 1.5, "seed": 1,
            "ignore_eos": True}
    status, _, first = post(server, "/v1/completions", body).parsed()
    assert status == 200
    texts = [c["text"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) > 1  # each choice has its own seed
    status, _, again = post(server, "/v1/completions", body).parsed()
    assert [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])] == texts


def test_legacy_logprobs_byte_tokens_and_text_offsets(server):
    body = {"prompt": "Say 🌊🌊🌊🌊", "temperature": 0, "max_tokens": 8, "logprobs": 5}
    status, _, reply = post(server, "/v1/completions", body).parsed()
    assert status == 200
    lp = reply["choices"][0]["logprobs"]
    assert all(len(top) == 5 for top in lp["top_logprobs"])  # byte tokens no longer collide
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob  # greedy: the chosen token is among the top, same value
    text = reply["choices"][0]["text"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(text)
    # Streamed: offsets continue across chunks and equal the non-streamed ones.
    offsets = []
    for line in post(server, "/v1/completions", {**body, "stream": True}).body.split(b"\n"):
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"][0]["logprobs"]:
                offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    assert offsets == lp["text_offset"]


@pytest.mark.parametrize("path,extra,param", [
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
])
def test_unimplemented_options_are_refused(server, path, extra, param):
    body = {"messages": HI} if path == CHAT else {"prompt": "Hi"}
    status, _, reply = post(server, path, {**body, "max_tokens": 2, **extra}).parsed()
    assert status == 400 and assert_error_shape(reply)["param"] == param


def _first_text(server, path, logit_bias=None) -> str:
    body = {"messages": HI} if path == CHAT else {"prompt": "The sea is"}
    body = {**body, "max_tokens": 1, "temperature": 0, **({"logit_bias": logit_bias} if logit_bias else {})}
    status, _, reply = post(server, path, body).parsed()
    assert status == 200, reply
    choice = reply["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_logit_bias_bans_the_greedy_token_and_forces_another(server, tokenizer, path):
    """OpenAI's logit_bias through llama.cpp's logit-bias sampler: -100 on the greedy first token
    changes it, +100 on a token makes it the first; ids outside the vocabulary are a 400."""
    greedy = _first_text(server, path)
    (greedy_id,) = tokenizer.encode(greedy, special=False, add_bos=False)
    assert _first_text(server, path, {str(greedy_id): -100}) != greedy
    (forced_id,) = tokenizer.encode(" banana", special=False, add_bos=False)
    assert _first_text(server, path, {str(forced_id): 100, str(greedy_id): -5}) == " banana"
    body = {"messages": HI} if path == CHAT else {"prompt": "Hi"}
    # Leading zeros would name one token twice, and llama.cpp would add the biases up past 100.
    for bad in ({str(tokenizer.n_vocab): 5}, {"-1": 5}, {"x": 5}, {"5": 101}, {"5": "high"}, [5],
                {"5": 8, "05": 8}, {"00000000001": 5}, {"1e3": 5}, {"\uff15": 5}):
        status, _, reply = post(server, path, {**body, "max_tokens": 2, "logit_bias": bad}).parsed()
        assert status == 400 and assert_error_shape(reply)["param"] == "logit_bias", (bad, reply)
    server.wait_idle()


def test_a_banned_token_is_never_emitted_where_a_format_allows_only_it(server, tokenizer):
    """A choice of one text allows only its canonical tokens
    (llguidance), so a -100 on one of them was emitted anyway. The text is spelled otherwise
    where the format allows it, and the request fails (400 ``constraint_failed``) where not."""
    (hello,) = tokenizer.encode("Hello", special=False, add_bos=False)
    ask = {"messages": HI, "max_tokens": 4, "logprobs": True, "logit_bias": {str(hello): -100}}
    status, _, reply = post(server, CHAT, {**ask, "structured_outputs": {"choice": ["Hello", "Goodbye"]}}).parsed()
    choice = reply["choices"][0]
    assert status == 200 and choice["message"]["content"] in ("Hello", "Goodbye"), reply
    assert "Hello" not in [t["token"] for t in choice["logprobs"]["content"]]
    status, _, reply = post(server, CHAT, {**ask, "structured_outputs": {"choice": ["Hello"]}}).parsed()
    assert status == 400 and assert_error_shape(reply)["code"] == "constraint_failed", reply
    server.wait_idle()


def test_compressed_body_is_415_and_head_health_is_200(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", CHAT, json.dumps({"messages": HI}),
                 {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    resp = conn.getresponse()
    assert resp.status == 415 and assert_error_shape(json.loads(resp.read()))
    conn.request("HEAD", "/health")
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200
    conn.close()
