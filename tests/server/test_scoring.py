"""Scoring prompts: ``echo`` with prompt log-probabilities on ``/v1/completions`` (the engine's
scoring kind, batched with generation), and the tokenizer routes in vLLM's shapes, against the
shared real server (Q8_0 weights, prefix cache on)."""
from __future__ import annotations

import json

import pytest

from server.http.completions import token_text
from tests.support.http import parse_sse, post, request

COMPLETIONS = "/v1/completions"


def ok(reply) -> dict:
    assert reply.status == 200, reply.body[:400]
    return reply.json()


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    """``n`` ordinary token ids (no special tokens), distinct per ``salt``."""
    return [(1000 + 37 * i + 101 * salt) % 40000 + 500 for i in range(n)]


def test_echo_scores_a_text_prompt_alone(server, tokenizer):
    """``max_tokens: 0`` with echo and logprobs: the prompt's entries only, the first null, the
    text the prompt's, offsets into it, usage the prompt's."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    body = ok(post(server, COMPLETIONS, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}))
    choice, ids = body["choices"][0], tokenizer.encode(prompt, add_bos=True)
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert lp["tokens"] == [token_text(tokenizer.piece(t)) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    for token, top, x in zip(lp["tokens"][1:], lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
        # the 2 most likely and the chosen token (OpenAI's legacy API, vLLM): a third entry when
        # the chosen one is not among them (found missing by a client-library helper)
        assert top[token] == x and max(top.values()) >= x
        assert len(top) == 2 or (len(top) == 3 and x <= min(v for t, v in top.items() if t != token)), top
    assert any(len(top) == 3 for top in lp["top_logprobs"][1:])  # this prompt has unlikely tokens
    assert [prompt[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    # "Paris" after "The capital of France is" is likely; "Italy is" ends the prompt, unscored.
    assert lp["token_logprobs"][lp["tokens"].index(" Paris")] > -3


def test_echo_of_token_prompts_with_n_and_generation(server, tokenizer):
    """lm-eval's shape (an array of token-id arrays, ``max_tokens: 1``), with ``n`` and a seed:
    every choice starts with its prompt's entries, the same for each choice of one prompt,
    then its generated tokens."""
    prompts = [prompt_ids(20, 1), prompt_ids(30, 2)]
    body = ok(post(server, COMPLETIONS, {"prompt": prompts, "max_tokens": 3, "echo": True, "logprobs": 1, "n": 2,
                                         "seed": 7, "temperature": 0.9, "ignore_eos": True}))
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    for c in choices:
        ids = prompts[c["index"] // 2]
        text = tokenizer.decode(ids)
        assert c["text"].startswith(text) and len(c["logprobs"]["tokens"]) == len(ids) + 3
        assert c["logprobs"]["tokens"][:len(ids)] == [token_text(tokenizer.piece(t)) for t in ids]
        assert c["logprobs"]["text_offset"][len(ids)] == len(text)  # the generated text follows the prompt
        assert None not in c["logprobs"]["token_logprobs"][1:]
    for a, b in ((choices[0], choices[1]), (choices[2], choices[3])):
        n = len(prompts[a["index"] // 2])
        assert a["logprobs"]["token_logprobs"][:n] == b["logprobs"]["token_logprobs"][:n]
    assert body["usage"]["completion_tokens"] == 12


def test_echo_without_logprobs_and_streamed(server):
    """Echo alone prefixes the text (``max_tokens: 0`` answers the prompt without the engine);
    streamed, each choice's first chunk carries its prompt and the prompt's entries, and the
    joined chunks equal the unstreamed answer."""
    plain = ok(post(server, COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 0, "echo": True}))
    assert plain["choices"][0]["text"] == "Once upon a time" and plain["choices"][0]["logprobs"] is None
    body = {"prompt": "Once upon a time", "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    whole = ok(post(server, COMPLETIONS, body))["choices"][0]
    assert whole["text"].startswith("Once upon a time") and len(whole["text"]) > len("Once upon a time")
    chunks = [c for c in parse_sse(request(server, "POST", COMPLETIONS, json.dumps({**body, "stream": True}).encode(),
                                           {"Content-Type": "application/json"}).body) if c != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"] == "Once upon a time" and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks if c["choices"][0]["logprobs"]),
               []) == whole["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("where, n_prompt", [("server", 40), ("app", 300)])
def test_greedy_token_has_one_logprob_generated_or_scored(request, where, n_prompt):
    """The log-probability of a greedy token is the same generated (cold, then with the prompt
    from the prefix cache) and scored as the last token of an echoed prompt (with an entry for
    that prompt in the cache or not; scoring never reuses one). Under 64 tokens on the default
    profile (every row on flash attention's row-by-row path); at 300 tokens (five chunks, past
    the one-thread rule's 256 cells) on the ``--deterministic`` app only: by default a 300-token
    chunk takes the tiled path, whose sums differ from the one row a cache hit decodes."""
    server = request.getfixturevalue(where)
    prompt = prompt_ids(n_prompt, 3 + n_prompt)
    generate = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    cold, warm = ok(post(server, COMPLETIONS, generate)), ok(post(server, COMPLETIONS, generate))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    (token,), (logprob,) = (cold["choices"][0]["logprobs"][k] for k in ("tokens", "token_logprobs"))
    assert warm["choices"][0]["logprobs"]["token_logprobs"] == [logprob]
    greedy_id = ok(post(server, "/tokenize", {"prompt": cold["choices"][0]["text"], "add_special_tokens": False}))
    scored = []
    for _ in range(2):  # the first scoring leaves prompt + token in the cache; the second finds it
        body = ok(post(server, COMPLETIONS, {"prompt": prompt + greedy_id["tokens"], "max_tokens": 0, "echo": True,
                                             "logprobs": 1}))
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        lp = body["choices"][0]["logprobs"]
        assert lp["tokens"][-1] == token and lp["top_logprobs"][-1] == {token: logprob}
        scored.append(lp["token_logprobs"])
    assert scored[0][-1] == scored[1][-1] == logprob
    assert scored[0] == scored[1]


def test_tokenize_and_detokenize(server, tokenizer, chat):
    text = "Hello <|im_end|> world"
    body = ok(post(server, "/tokenize", {"prompt": text, "return_token_strs": True}))
    assert body["tokens"] == tokenizer.encode(text, special=True, add_bos=True) and 2 in body["tokens"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert "".join(body["token_strs"]) == text
    assert ok(post(server, "/tokenize", {"prompt": text}))["token_strs"] is None
    assert ok(post(server, "/detokenize", {"tokens": body["tokens"]})) == {"prompt": text}
    messages = [{"role": "user", "content": "Hi"}]
    tokens = ok(post(server, "/tokenize", {"messages": messages, "model": "local-model"}))["tokens"]
    assert tokens == chat.encode(messages)
    usage = ok(post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}))["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    assert ok(post(server, "/detokenize", {"tokens": []})) == {"prompt": ""}


def test_tokenize_renders_tools_and_tool_call_history_as_the_chat_does(server):
    """A conversation with a call and its result, and tools offered: ``/tokenize`` counts the
    prompt a chat completion of the same messages and tools is given (this template has no tool
    syntax: the generic format's text), and a prompt without the tools is shorter."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    with_tools = ok(post(server, "/tokenize", {"messages": messages, "tools": tools}))["count"]
    without = ok(post(server, "/tokenize", {"messages": messages}))["count"]
    chat = ok(post(server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 1,
                                                    "tool_choice": "none"}))
    assert with_tools > without
    assert chat["usage"]["prompt_tokens"] == without  # tool_choice none: no tools in the prompt
    chat = ok(post(server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 1}))
    assert chat["usage"]["prompt_tokens"] == with_tools


def test_tokenize_refuses_tools_whose_description_cannot_fit_before_rendering_it(server):
    """48 KB of nested arrays in a tool's schema (the shared server's bodies are at most 64 KiB):
    the generic format's indented description of it is over 3 million characters (100 KB took
    8 s and 400,000 tokens for /tokenize to count); the indentation counts in the size check, so
    it is refused before anything is rendered."""
    nested = json.loads("[" * 120 + "]" * 120)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "examples": [nested] * 200}}}]
    reply = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert reply.status == 400 and reply.json()["error"]["code"] == "context_length_exceeded", reply.body[:300]


def test_tokenize_refuses_a_chat_the_chat_route_refuses_as_too_long(server):
    """A chat whose rendering is over the sequence limit (/tokenize answered
    200 with its 8,223 tokens, where /v1/chat/completions refuses the same chat): both refuse it,
    400 ``context_length_exceeded`` naming ``messages``; one just under the limit is counted. A
    ``prompt`` over the limit is still counted: lm-eval tokenizes whole documents and splits them
    itself."""
    def chat_of(words: int) -> list:
        return [{"role": "user", "content": " ".join(["word"] * words)}]
    fits = ok(post(server, "/tokenize", {"messages": chat_of(400)}))["count"]
    assert fits < 511
    long = chat_of(400 + 512 - fits)  # one "word" is one token here: the rendering is 512 or more
    for path in ("/tokenize", "/v1/chat/completions"):
        reply = post(server, path, {"messages": long, "max_tokens": 1} if path != "/tokenize" else {"messages": long})
        assert reply.status == 400, (path, reply.body[:300])
        err = reply.json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", "messages"), (path, err)
    assert ok(post(server, "/tokenize", {"prompt": " ".join(["word"] * 600)}))["count"] > 512


def test_tokenizer_info(server, tokenizer):
    info = ok(request(server, "GET", "/tokenizer_info"))
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 512
    assert info["vocab_size"] == tokenizer.n_vocab and info["add_bos_token"] is False
    assert request(server, "HEAD", "/tokenizer_info").status == 200


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "tools": [{"type": "x"}]}, "tools[0].type"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
                   "tools": [{"type": "function", "function": {"name": "f"}}], "continue_final_message": True},
     "continue_final_message"),  # as the chat route refuses it
    ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
    ("/tokenize", {"messages": [{"role": "function", "content": "b"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    (COMPLETIONS, {"prompt": "a", "echo": 1}, "echo"),
    (COMPLETIONS, {"prompt": "a", "echo": True, "best_of": 2}, "best_of"),
])
def test_bad_tokenizer_and_echo_input_is_a_400(server, path, body, param):
    reply = post(server, path, body)
    assert reply.status == 400 and reply.json()["error"]["param"] == param, reply.body


def test_tokenizer_routes_take_the_model_routes_keys(app):
    """With a tenant file, no key (or an unknown one) is a 401 on every tokenizer route; a
    tenant's key is served."""
    from server.tenancy.tenants import TenantRegistry, Tenants, parse
    from tests.support.servers import AppServer

    keyed = AppServer(app.config, app.generator,
                      TenantRegistry(Tenants(parse({"tenants": [{"id": "t", "api_keys": ["key-t"]}]}))))
    for key, status in ((None, 401), ("nope", 401), ("key-t", 200)):
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        assert request(keyed, "GET", "/tokenizer_info", None, headers).status == status
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert request(keyed, "POST", path, json.dumps(body).encode(), headers).status == status
