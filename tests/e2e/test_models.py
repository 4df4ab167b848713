"""Several models in one server (docs/models.md): SmolLM2-135M-Instruct for chat, Gemma 3 270M (a
base model) for completions and SmolLM2 again as an embedding model with mean pooling, each in
its own engine process behind the same gunicorn workers and gRPC sidecar. Every route on each
model; the refusals of a route a model does not serve; a tenant limited to one model; the
OpenAI SDK, LangChain and LiteLLM against ``/v1/embeddings``; one engine killed while the
others serve."""
from __future__ import annotations

import base64
import json
import os
import signal
import time

import numpy as np
import pytest

from tests.support.http import get, post
from tests.support.servers import cmdline, running_server

FULL, LIMITED, NARROW = "sk-full-0123456789abcdef", "sk-gemma-only-0123456789", "sk-narrow-0123456789abc"
METERED, ADMIN = "sk-metered-0123456789abc", "admin-models-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {FULL}"}
TEXTS = ["The cat sat on the mat.", "A dog ran in the park.", "Stocks fell sharply on Monday.",
         "Photosynthesis turns light into sugar.", "hello", "The quick brown fox jumps over the lazy dog " * 20]


def _toml(models: list[dict]) -> str:
    return "".join("[[models]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in m.items()) for m in models)


@pytest.fixture(scope="module")
def three(tmp_path_factory, model_path, gemma_model_path):
    folder = tmp_path_factory.mktemp("models")
    sizes = {"max_slots": 2, "max_seq_len": 512, "kv_cache_tokens": 1024, "prefix_cache_tokens": 0}
    (folder / "models.toml").write_text(_toml([
        {"names": ["smollm2", "local-model"], "path": model_path, **sizes},
        {"names": ["gemma"], "path": gemma_model_path, **sizes},
        {"names": ["embed"], "path": model_path, "kind": "embed", "pooling": "mean", "max_slots": 8}]))
    (folder / "tenants.toml").write_text(
        f'[[tenants]]\nid = "full"\napi_keys = ["{FULL}"]\n\n'
        f'[[tenants]]\nid = "limited"\napi_keys = ["{LIMITED}"]\nmodels = ["gemma"]\n\n'
        f'[[tenants]]\nid = "narrow"\napi_keys = ["{NARROW}"]\nmax_concurrent = 3\n\n'
        f'[[tenants]]\nid = "metered"\napi_keys = ["{METERED}"]\n')
    with running_server("--models", str(folder / "models.toml"), "--tenants", str(folder / "tenants.toml"),
                        # the drain test (last) must not meet the drain's timeout on a loaded machine
                        "--workers", "1", "--threads", "16", "--drain-timeout", "120", grpc=True,
                        env={"ADMIN_KEYS": ADMIN}) as server:
        yield server


def _json(server, path, body, key=FULL):
    r = post(server, path, body, headers={"Authorization": f"Bearer {key}"})
    return r.status, json.loads(r.body)


def _embed(server, inputs, **extra):
    status, body = _json(server, "/v1/embeddings", {"model": "embed", "input": inputs, **extra})
    assert status == 200, body
    return np.array([d["embedding"] for d in body["data"]], np.float32), body


def test_every_route_on_each_model(three):
    """Chat, Responses and the chat ``/tokenize`` on the chat model; completions, ``/infer`` and
    the tokenizer routes on each generation model; embeddings on the embedding model; ``/v1/models``
    lists every name with what it serves."""
    cards = {c["id"]: c for c in json.loads(get(three, "/v1/models", headers=AUTH).body)["data"]}
    assert {k: (c["root"], c["capabilities"]) for k, c in cards.items()} == {
        "smollm2": ("smollm2", ["completion", "chat"]), "local-model": ("smollm2", ["completion", "chat"]),
        "gemma": ("gemma", ["completion"]), "embed": ("embed", ["embedding"])}
    for model in ("smollm2", "local-model"):
        status, body = _json(three, "/v1/chat/completions", {"model": model, "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 200 and body["model"] == model and body["usage"]["completion_tokens"] == 4, body
    status, body = _json(three, "/v1/responses", {"model": "smollm2", "input": "Hi", "max_output_tokens": 4})
    assert status == 200 and body["status"] in ("completed", "incomplete"), body
    for model in ("smollm2", "gemma"):
        status, body = _json(three, "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                                        "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["model"] == model and body["choices"][0]["text"], body
        status, body = _json(three, "/infer", {"model": model, "payload": "Paris is", "max_new_tokens": 3})
        assert status == 200 and body["tokens"] == 3, body
    # each model's own tokenizer: Gemma's 262,144-token vocabulary is not SmolLM2's
    counts = {}
    for model in ("smollm2", "gemma", "embed"):
        status, body = _json(three, "/tokenize", {"model": model, "prompt": "Bonjour le monde"})
        assert status == 200, body
        counts[model] = body["tokens"]
        status, back = _json(three, "/detokenize", {"model": model, "tokens": body["tokens"]})
        assert status == 200 and back["prompt"].endswith("Bonjour le monde"), back
        info = json.loads(get(three, f"/tokenizer_info?model={model}", headers=AUTH).body)
        assert info["vocab_size"] == (262144 if model == "gemma" else 49152), info
    assert counts["smollm2"] == counts["embed"] != counts["gemma"]
    vectors, body = _embed(three, TEXTS[:2])
    assert vectors.shape == (2, 576) and body["model"] == "embed" and body["object"] == "list"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_a_route_a_model_does_not_serve_names_the_models_that_do(three):
    cases = [("/v1/embeddings", {"model": "gemma", "input": "x"}, "models that can: embed"),
             ("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user", "content": "x"}]},
              "models that can: smollm2"),
             ("/v1/completions", {"model": "embed", "prompt": "x"}, "models that can: smollm2, gemma"),
             ("/infer", {"model": "embed", "payload": "x"}, "models that can: smollm2, gemma")]
    for path, body, says in cases:
        status, answer = _json(three, path, body)
        assert status == 400 and answer["error"]["param"] == "model" and says in answer["error"]["message"], answer
    status, answer = _json(three, "/v1/chat/completions", {"model": "gemma", "messages": [{"role": "user",
                                                                                          "content": "x"}]})
    assert status == 400 and answer["error"]["code"] == "chat_template_missing", answer
    status, answer = _json(three, "/v1/embeddings", {"model": "gpt-4o", "input": "x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    # without model: the first model that serves the route
    status, answer = _json(three, "/v1/embeddings", {"input": "x"})
    assert status == 200 and answer["model"] == "embed", answer


def test_a_tenant_limited_to_one_model_cannot_use_the_others(three):
    """The tenant file's ``models``: every other model is 404 ``model_not_found`` (as one that
    does not exist) on every route, and left out of its ``/v1/models``."""
    cards = json.loads(get(three, "/v1/models", headers={"Authorization": f"Bearer {LIMITED}"}).body)["data"]
    assert [c["id"] for c in cards] == ["gemma"]
    assert get(three, "/v1/models/smollm2", headers={"Authorization": f"Bearer {LIMITED}"}).status == 404
    for path, body in (("/v1/chat/completions", {"model": "local-model", "messages": [{"role": "user",
                                                                                       "content": "x"}]}),
                       ("/v1/embeddings", {"model": "embed", "input": "x"}),
                       ("/tokenize", {"model": "smollm2", "prompt": "x"})):
        status, answer = _json(three, path, body, key=LIMITED)
        assert status == 404 and answer["error"]["code"] == "model_not_found", answer
        assert answer["error"]["message"].endswith("models here: gemma"), answer  # never the others
    status, answer = _json(three, "/v1/completions", {"model": "gemma", "prompt": "x", "max_tokens": 2}, key=LIMITED)
    assert status == 200, answer


def test_usage_counts_each_model_under_its_api(three):
    """OpenAI's usage routes by the kind of model: ``/usage/completions`` sums the generation
    models' requests, ``/usage/embeddings`` the embedding model's (HTTP and gRPC), token for token
    what the clients were told; neither holds the other's."""
    import grpc

    from proto import inference_pb2 as pb
    from proto import inference_pb2_grpc

    started = int(time.time()) - 60
    texts = ["one input", "and a second, longer input of several words"]
    status, chat = _json(three, "/v1/chat/completions", {"model": "smollm2", "max_tokens": 3,
                                                         "messages": [{"role": "user", "content": "hi"}]}, key=METERED)
    assert status == 200, chat
    status, completion = _json(three, "/v1/completions", {"model": "gemma", "prompt": "x", "max_tokens": 2},
                               key=METERED)
    assert status == 200, completion
    _, first = _json(three, "/v1/embeddings", {"model": "embed", "input": texts}, key=METERED)
    with grpc.insecure_channel(f"127.0.0.1:{three.grpc_port}") as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Embed(
            pb.EmbedRequest(model="embed", input=["by gRPC"]), metadata=(("authorization", f"Bearer {METERED}"),))
    embedded = first["usage"]["prompt_tokens"] + reply.usage.prompt_tokens
    auth = {"Authorization": f"Bearer {ADMIN}"}

    def page(api: str) -> dict:
        query = f"start_time={started}&bucket_width=1d&group_by=model&project_ids=metered"
        r = get(three, f"/v1/organization/usage/{api}?{query}", headers=auth)
        assert r.status == 200, r.body
        return {x["model"]: x for bucket in json.loads(r.body)["data"] for x in bucket["results"]}

    deadline = time.monotonic() + 5  # written as each request ends
    while sum(x["num_model_requests"] for x in page("embeddings").values()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert page("embeddings") == {"embed": {"object": "organization.usage.embeddings.result", "input_tokens": embedded,
                                            "num_model_requests": 2, "project_id": None, "user_id": None,
                                            "api_key_id": None, "model": "embed"}}
    completions = page("completions")
    assert set(completions) == {"smollm2", "gemma"}, completions
    assert completions["smollm2"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert completions["gemma"]["output_tokens"] == completion["usage"]["completion_tokens"]
    # a model's filter by any name it is served under (usage is kept under its first)
    q = f"start_time={started}&group_by=model&project_ids=metered&models=local-model"
    r = get(three, f"/v1/organization/usage/completions?{q}", headers=auth)
    assert [x["model"] for b in json.loads(r.body)["data"] for x in b["results"]] == ["smollm2"], r.body
    for query, param in (("batch=true", "batch"),  # completions' only
                         ("user_ids[]=u", "user_ids"), ("bucket_width[]=1m", "bucket_width"),
                         (f"end_time={started - 86400}", "end_time")):
        r = get(three, f"/v1/organization/usage/embeddings?start_time={started}&{query}", headers=auth)
        assert r.status == 400 and json.loads(r.body)["error"]["param"] == param, (query, r.body)
    r = get(three, f"/v1/organization/usage/embeddings?start_time={started}&group_by=user_id", headers=auth)
    assert r.status == 400 and "no users" in json.loads(r.body)["error"]["message"], r.body


def test_embeddings_are_unit_vectors_the_same_alone_or_batched(three):
    """Each input alone and all together (one decode holds several): cosine >= 0.999; token ids
    give the text's vector; ``base64`` is the same float32 vector."""
    together, _ = _embed(three, TEXTS)
    alone = np.stack([_embed(three, text)[0][0] for text in TEXTS])
    assert np.allclose(np.linalg.norm(together, axis=1), 1, atol=1e-4)
    assert (np.sum(together * alone, axis=1) >= 0.999).all()
    ids = _json(three, "/tokenize", {"model": "embed", "prompt": TEXTS[0]})[1]["tokens"]
    by_ids, _ = _embed(three, [ids])
    assert float(by_ids[0] @ together[0]) >= 0.999
    status, body = _json(three, "/v1/embeddings", {"model": "embed", "input": TEXTS[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    assert status == 200 and float(decoded @ together[0]) >= 0.999
    assert float(together[0] @ together[1]) > float(together[0] @ together[2])  # two animals closer than stocks


def test_token_ids_are_this_models_vocabulary(three):
    """Token ids are read as the embedding model's own (OpenAI's and vLLM's rule): its ids of a
    text give the text's vector; another vocabulary's ids for the same text (Gemma's here, as
    tiktoken's from LangChain's default) are other tokens and give another vector, and ids
    beyond this vocabulary are refused by name."""
    expected, _ = _embed(three, TEXTS[0])
    own = _json(three, "/tokenize", {"model": "embed", "prompt": TEXTS[0]})[1]["tokens"]
    other = [t for t in _json(three, "/tokenize", {"model": "gemma", "prompt": TEXTS[0]})[1]["tokens"] if t < 49152]
    assert float(_embed(three, [own])[0][0] @ expected[0]) >= 0.999
    assert float(_embed(three, [other])[0][0] @ expected[0]) < 0.99
    status, answer = _json(three, "/v1/embeddings", {"model": "embed", "input": [[100_256, 9906]]})
    assert status == 400 and answer["error"]["param"] == "input" and "outside this model's vocabulary" in \
        answer["error"]["message"], answer


def test_embeddings_refuse_by_name(three):
    long_text = "word " * 1100
    cases = [({"input": ""}, "input"), ({"input": ["ok", ""]}, "input[1]"), ({"input": []}, "input"),
             ({"input": [[1, 2], "x"]}, "input[1]"), ({"input": [{}]}, "input[0]"), ({"input": [[1, 10**6]]}, "input"),
             ({"input": ["a", [1, 10**6]]}, "input[1]"), ({"input": "x", "dimensions": 64}, "dimensions"),
             ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": long_text}, "input"),
             ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
             ({"input": "x", "frobnicate": 1}, "frobnicate"), ({"input": ["x"] * 2049}, "input")]
    for body, param in cases:
        status, answer = _json(three, "/v1/embeddings", {"model": "embed", **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    vectors, body = _embed(three, long_text, truncate_prompt_tokens=100)
    assert body["usage"]["prompt_tokens"] == 100
    status, answer = _json(three, "/v1/embeddings", {"model": "embed", "input": "x", "dimensions": 576})
    assert status == 200, answer


def test_many_inputs_pass_through_the_engine_in_turn(three):
    """300 inputs, more than the embedding engine's 136 mailboxes (8 slots, 128 queue places): all
    answered, in order; a tenant allowed 3 sequences at once gets 10 inputs through, 3 at a
    time; each request's log line and metrics count its input tokens as a finished request."""
    inputs = [f"sentence number {i} about topic {i % 7}" for i in range(300)]
    vectors, body = _embed(three, inputs)
    assert vectors.shape == (300, 576)
    again, _ = _embed(three, inputs[150:152])
    assert (np.sum(vectors[150:152] * again, axis=1) >= 0.999).all()
    status, narrow = _json(three, "/v1/embeddings", {"model": "embed", "input": inputs[:10]}, key=NARROW)
    assert status == 200 and len(narrow["data"]) == 10, narrow
    metrics = get(three, "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).body.decode()
    assert 'inference_requests_total{finish_reason="stop",route="/v1/embeddings",status="200",tenant="narrow"} 1.0' \
        in metrics, [line for line in metrics.splitlines() if "embeddings" in line]
    lines = [json.loads(line) for line in open(three.log) if line.startswith('{"request_id"')]
    (line,) = [x for x in lines if x["tenant"] == "narrow"]
    assert line["finish_reason"] == "stop" and line["prompt_tokens"] == narrow["usage"]["prompt_tokens"], line


def test_the_clients_people_use(three):
    """The OpenAI SDK (base64 by default, float asked), LangChain's ``OpenAIEmbeddings`` and
    LiteLLM's ``embedding()``. LangChain counts text with tiktoken and by default sends OpenAI's
    token ids, which are other words here (docs/models.md; tiktoken's tables download from the
    internet, so that default cannot even run here): with ``check_embedding_ctx_length=False`` it
    sends the text, and gets the text's vectors."""
    import litellm
    import openai
    from langchain_openai import OpenAIEmbeddings

    expected, _ = _embed(three, TEXTS[:3])
    client = openai.OpenAI(base_url=three.url + "/v1", api_key=FULL)
    got = client.embeddings.create(model="embed", input=TEXTS[:3])
    assert (np.sum(np.array([d.embedding for d in got.data]) * expected, axis=1) >= 0.999).all()
    assert got.usage.prompt_tokens > 0
    floats = client.embeddings.create(model="embed", input=TEXTS[0], encoding_format="float")
    assert float(np.array(floats.data[0].embedding) @ expected[0]) >= 0.999
    lc = OpenAIEmbeddings(model="embed", base_url=three.url + "/v1", api_key=FULL, check_embedding_ctx_length=False)
    assert (np.sum(np.array(lc.embed_documents(TEXTS[:3])) * expected, axis=1) >= 0.999).all()
    assert float(np.array(lc.embed_query(TEXTS[0])) @ expected[0]) >= 0.999
    answer = litellm.embedding(model="openai/embed", input=TEXTS[:2], api_base=three.url + "/v1", api_key=FULL)
    assert (np.sum(np.array([d["embedding"] for d in answer.data]) * expected[:2], axis=1) >= 0.999).all()


def test_grpc_serves_each_model(three):
    import grpc

    from proto import inference_pb2 as pb
    from proto import inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{three.grpc_port}"))
    meta = (("authorization", f"Bearer {FULL}"),)
    answer = stub.Embed(pb.EmbedRequest(model="embed", input=TEXTS[:2]), metadata=meta)
    expected, _ = _embed(three, TEXTS[:2])
    assert (np.sum(np.array([list(d.embedding) for d in answer.data]) * expected, axis=1) >= 0.999).all()
    assert stub.Infer(pb.InferRequest(model="gemma", payload="Paris is", max_new_tokens=2), metadata=meta).tokens == 2
    chat = stub.ChatComplete(pb.ChatRequest(model="smollm2", max_tokens=2, messages=[
        pb.ChatMessage(role="user", content="Hi")]), metadata=meta)
    assert chat.model == "smollm2" and chat.usage.completion_tokens == 2
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(model="gemma", input=["x"]), metadata=meta)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "models that can: embed" in e.value.details()


def _engine_pid(server, model_path_part: bytes, kind: bytes) -> int:
    for pid in server.children():
        line = cmdline(pid) or b""
        if b"engine.process" in line and model_path_part in line and kind in line:
            return pid
    raise AssertionError("no such engine process")


def test_killing_one_engine_leaves_the_others_serving(three):
    """SIGKILL Gemma's engine: while its supervisor starts another, chat and embeddings answer;
    then Gemma answers again."""
    pid = _engine_pid(three, b"gemma", b'"kind": "generate"')
    os.kill(pid, signal.SIGKILL)
    _embed(three, "still here")
    status, body = _json(three, "/v1/chat/completions", {"model": "smollm2", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, body
    end = time.monotonic() + 120
    while True:
        status, body = _json(three, "/v1/completions", {"model": "gemma", "prompt": "Paris is", "max_tokens": 2})
        if status == 200:
            break
        assert status == 503 and time.monotonic() < end, body
        time.sleep(0.5)
    assert _engine_pid(three, b"gemma", b'"kind": "generate"') != pid


def _embed_engine(server):
    """The embedding engine's client (its segment named in the start-up log)."""
    from engine.client import EngineClient

    for line in open(server.log):
        if "engine of embed starting" in line:
            return EngineClient.attach(line.rsplit("shared memory ", 1)[1].strip())
    raise AssertionError("no embedding engine in the log")


def test_a_cancelled_grpc_embed_call_frees_its_inputs(three):
    """gRPC ``Embed`` of 400 inputs cancelled after a second: its inputs are cancelled, none left
    in flight within a few seconds (not computed to the end)."""
    import grpc

    from proto import inference_pb2 as pb
    from proto import inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{three.grpc_port}"))
    engine = _embed_engine(three)
    try:
        call = stub.Embed.future(pb.EmbedRequest(model="embed", input=[f"{TEXTS[5]} {i}" for i in range(400)]),
                                 metadata=(("authorization", f"Bearer {FULL}"),))
        end = time.monotonic() + 30
        while engine.mailboxes_in_use() == 0:
            assert time.monotonic() < end
            time.sleep(0.05)
        call.cancel()
        end = time.monotonic() + 10
        while engine.mailboxes_in_use():
            assert time.monotonic() < end, engine.mailboxes_in_use()
            time.sleep(0.05)
    finally:
        engine.close()


def test_a_drain_finishes_an_embedding_request_under_way(three):
    """SIGTERM while a request of 60 inputs of about 50 tokens is under way (more than its window
    of 8): the drain lets it finish, every input answered; a new request gets 503. (Last: the
    server stops.)"""
    import threading

    inputs = [f"drained sentence {i}: " + TEXTS[5][:200] for i in range(60)]
    answer = {}
    worker = threading.Thread(target=lambda: answer.update(reply=_json(three, "/v1/embeddings",
                                                                       {"model": "embed", "input": inputs})))
    worker.start()
    engine = _embed_engine(three)
    try:
        end = time.monotonic() + 30
        while engine.mailboxes_in_use() == 0:
            assert time.monotonic() < end
            time.sleep(0.05)
    finally:
        engine.close()
    three.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + 10
    while get(three, "/health/ready").status != 503:  # the drain began
        assert time.monotonic() < end
        time.sleep(0.05)
    status, refused = _json(three, "/v1/embeddings", {"model": "embed", "input": "late"})
    assert status == 503 and refused["error"]["code"] == "server_shutting_down", refused
    worker.join(120)
    status, body = answer["reply"]
    assert status == 200 and len(body["data"]) == 60, body
