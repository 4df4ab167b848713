"""The HTTP server end to end: a real ``inference-server`` (gunicorn + engine + model).

Covers the official ``openai`` client, concurrent streaming equality, client disconnects
(contract cases 24, 25), overload (case 26), ``/infer``, ``/health`` and start-up errors.
Nothing is asserted on wall-clock time: engine step counters and slot tables are the clock.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from shm import Finish, MailboxState
from tests.support.http import assert_error_shape, chat_body, get, post
from tests.support.servers import free_port, running_server

MODEL = "local-model"
GREEDY = {"temperature": 0}
FIXED = {"ignore_eos": True}


# -- helpers --------------------------------------------------------------------------------------
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def wait_for(predicate, what: str, timeout: float = 30.0, interval: float = 0.001):
    """Poll ``predicate`` until truthy (a safety net against hangs, not a timing assertion)."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(interval)


class RawStream:
    """A streaming request over a bare socket, so the test decides exactly when it closes."""

    EVENT = re.compile(rb"data: (.*?)\n\n", re.S)

    def __init__(self, server, path: str, body: dict):
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        self.sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: test\r\n"
                          b"Content-Type: application/json\r\n"
                          b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        self.buf = b""
        self.closed = False

    def events(self) -> list[bytes]:
        return self.EVENT.findall(self.buf)

    def read_until(self, predicate) -> None:
        while not predicate(self):
            data = self.sock.recv(65536)
            assert data, "server closed the stream early:\n" + self.buf.decode(errors="replace")
            self.buf += data

    def first_token(self) -> None:
        """Read until an event that carries generated text (the sequence is decoding)."""
        def has_text(s):
            for e in s.events():
                if e != b"[DONE]":
                    for c in json.loads(e).get("choices", []):
                        if c.get("text") or c.get("delta", {}).get("content"):
                            return True
            return False
        self.read_until(has_text)

    def finish(self) -> list[dict]:
        """Read to ``data: [DONE]``; returns the JSON chunks."""
        self.read_until(lambda s: b"data: [DONE]\n\n" in s.buf)
        self.close()
        events = self.events()
        assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
        return [json.loads(e) for e in events[:-1]]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


class SlotWatcher:
    """Records every mailbox index the engine's slot table shows, in a background thread."""

    def __init__(self, engine):
        self.engine = engine
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.seen.update(m for m in self.engine.slot_mailboxes() if m != -1)
            time.sleep(0.0005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# -- servers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide():
    """16 slots: room for 16 concurrent sequences."""
    with running_server("--max-slots", "16", "--max-seq-len", "256", "--threads", "24") as s:
        yield s


# -- the official openai client ------------------------------------------------------------------
def test_sdk_chat_completion(server):
    r = sdk(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        extra_body=FIXED)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_sdk_chat_completion_streamed(server):
    client = sdk(server)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}],
                  max_tokens=12, temperature=0, extra_body=FIXED)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    text, finishes, usage = [], [], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        assert c.index == 0
        text.append(c.delta.content or "")
        if c.finish_reason:
            finishes.append(c.finish_reason)
    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == 12
    alone = client.chat.completions.create(**kwargs)
    assert "".join(text) == alone.choices[0].message.content
    assert usage.prompt_tokens == alone.usage.prompt_tokens


def test_sdk_completion(server):
    r = sdk(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                       extra_body=FIXED)
    assert r.object == "text_completion" and r.model == MODEL
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and isinstance(c.text, str) and c.text
    assert r.usage.completion_tokens == 6


def test_sdk_completion_streamed(server):
    client = sdk(server)
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body=FIXED)
    text, finishes = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        (c,) = chunk.choices
        text.append(c.text)
        if c.finish_reason:
            finishes.append(c.finish_reason)
    assert finishes == ["length"]
    assert "".join(text) == client.completions.create(**kwargs).choices[0].text


def test_sdk_models_list(server):
    """The model under the name its GGUF gives (``general.name``, spaces made ``-``), then the
    alias every earlier client used; both can chat (the bundled model has a chat template)."""
    client = sdk(server)
    models = client.models.list().data
    assert [m.id for m in models] == ["Smollm2-135M-8k-Lc100K-Mix1-Ep2", MODEL]
    assert models[0].object == "model"
    assert models[0].model_extra["context_length"] == server.engine.max_seq_len == 512
    assert all(m.model_extra["capabilities"] == ["completion", "chat"] for m in models)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.status_code == 404 and e.value.code == "model_not_found"


def test_sdk_unknown_model_is_not_found(server):
    client = sdk(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2, stream=True)
    assert e.value.code == "model_not_found"


def test_sdk_bad_temperature_is_bad_request(server):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            temperature=3, max_tokens=2)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_prompt_too_long_is_bad_request(server, stream):
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 600, max_tokens=4, stream=stream)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert "511" in e.value.message or "512" in e.value.message
    # The server answers a normal request right after.
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=FIXED)
    assert r.usage.completion_tokens == 2


def test_sdk_n_2_returns_two_choices(server):
    r = sdk(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a joke."}],
                                            n=2, max_tokens=4, extra_body=FIXED)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 8


# -- concurrency -----------------------------------------------------------------------------------
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Say hello in Spanish.", "What is 2 + 2?", "Name a color of the rainbow.",
           "Describe a cat in one sentence.", "Why is the sky blue?", "Give me a synonym for happy.",
           "What do bees make?", "Name a planet in our solar system.", "How many legs does a spider have?",
           "Suggest a name for a dog.", "What is the opposite of cold?", "Name a famous painter.",
           "What language is spoken in Brazil?"]


def test_16_concurrent_streams_equal_solo_requests(wide):
    client = sdk(wide)
    wide.wait_idle()
    kwargs = [dict(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24, **GREEDY)
              for p in PROMPTS]
    streamed: list[str | None] = [None] * len(PROMPTS)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS))

    def run(i):
        try:
            barrier.wait()
            parts = []
            for chunk in client.chat.completions.create(stream=True, **kwargs[i]):
                for c in chunk.choices:
                    parts.append(c.delta.content or "")
            streamed[i] = "".join(parts)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    busy = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            busy.append(sum(m != -1 for m in wide.engine.slot_mailboxes()))
            time.sleep(0.005)  # steps take longer: each is still seen

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    stop.set()
    watcher.join()
    assert not errors, errors
    print(f"most slots busy at once: {max(busy)}")
    assert max(busy) > 1, "the streams never ran together"
    for i, kw in enumerate(kwargs):
        alone = client.chat.completions.create(**kw).choices[0].message.content
        assert streamed[i], PROMPTS[i]
        assert streamed[i] == alone, (PROMPTS[i], streamed[i], alone)
    wide.wait_idle()


# -- disconnects (cases 24, 25) --------------------------------------------------------------------
def test_stream_client_disconnect_frees_slot_within_steps(server):
    """Case 24: the slot is free within one engine step of the close (a step or two of slack for
    the front-end thread to notice), and the next request runs normally."""
    server.wait_idle()
    engine = server.engine
    s = RawStream(server, "/v1/chat/completions",
                  chat_body("Write a long story about a dragon.", max_tokens=200, stream=True, **FIXED))
    s.first_token()
    wait_for(lambda: any(m != -1 for m in engine.slot_mailboxes()), "the slot table to show the stream")
    s.close()
    closed_at = engine.step()
    freed_at = wait_for(lambda: engine.step() if all(m == -1 for m in engine.slot_mailboxes()) else None,
                        "the slot to be freed")
    print(f"slot freed {freed_at - closed_at} steps after the close")
    assert freed_at - closed_at <= 3
    server.wait_idle()
    # A normal request on the idle server right after: streams its first token and runs to length.
    nxt = RawStream(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5,
                                                "stream": True, "stream_options": {"include_usage": True},
                                                **FIXED})
    nxt.first_token()
    chunks = nxt.finish()
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    server.wait_idle()


def test_queued_client_disconnect_is_never_decoded(single):
    """Case 25: with the only slot busy, a queued request whose client leaves is dropped from the
    queue while the slot is still held by the other request, so it never reaches a slot."""
    engine, boxes = single.engine, single.engine.t.mailboxes.boxes
    single.wait_idle()
    with SlotWatcher(engine) as watcher:
        blocker = RawStream(single, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                        "max_tokens": 150, "stream": True, **FIXED})
        blocker.first_token()
        held = wait_for(lambda: engine.slot_mailboxes()[0] + 1, "the blocker to hold the slot") - 1
        queued = RawStream(single, "/v1/chat/completions", chat_body("Hi", max_tokens=50, **FIXED))
        wait_for(lambda: engine.mailboxes_in_use() == 2, "the second request to be queued")
        (other,) = [i for i in range(len(boxes)) if i != held and int(boxes["state"][i]) != MailboxState.FREE]
        queued.close()  # before any response byte
        wait_for(lambda: int(boxes["state"][other]) == MailboxState.FREE, "the queued request to be released")
        # Released while the only slot still decodes the blocker: the queued one never ran.
        assert engine.slot_mailboxes() == [held]
        assert float(boxes["t_admitted"][other]) == 0.0 and int(boxes["step_admitted"][other]) == 0
        assert int(boxes["finish"][other]) == Finish.CANCELLED
        chunks = blocker.finish()
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        single.wait_idle(timeout=0.5)
    assert watcher.seen == {held}


# -- overload (case 26) ----------------------------------------------------------------------------
def test_one_slot_one_queue_six_requests(single):
    single.wait_idle()
    body = chat_body("Write a poem about autumn.", max_tokens=48, **FIXED)
    results: list = [None] * 6
    barrier = threading.Barrier(6)

    def run(i):
        barrier.wait()
        t0 = time.monotonic()
        status, headers, payload = post(single, "/v1/chat/completions", body).parsed()
        results[i] = (status, headers, payload, (time.monotonic() - t0) * 1000)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(r[0] for r in results) == [200, 200, 503, 503, 503, 503], [r[:3] for r in results]
    for status, headers, payload, _ in results:
        if status == 200:
            assert payload["usage"]["completion_tokens"] == 48
            assert payload["choices"][0]["finish_reason"] == "length"
        else:
            assert headers["retry-after"].isdigit() and int(headers["retry-after"]) > 0
            assert headers["content-type"].startswith("application/json")
            err = assert_error_shape(payload, "server_error")
            assert err["code"] == "server_overloaded"
    print("503 latencies (ms):", sorted(round(r[3], 1) for r in results if r[0] == 503))
    single.wait_idle()


# -- /infer ----------------------------------------------------------------------------------------
def test_infer_returns_text_tokens_and_timings(server):
    status, _, r = post(server, "/infer", {"tenant_id": "acme", "payload": "Write a long story about a dragon.",
                                           "max_new_tokens": 8, "priority": "high"}).parsed()
    assert status == 200, r
    assert set(r) == {"tenant_id", "text", "tokens", "cached_tokens", "finish_reason", "queue_wait_ms", "latency_ms"}
    assert r["tenant_id"] == "acme"
    assert isinstance(r["text"], str) and r["text"]
    assert r["tokens"] == 8 and r["finish_reason"] == "length"
    for k in ("queue_wait_ms", "latency_ms"):
        assert isinstance(r[k], (int, float)) and not isinstance(r[k], bool) and r[k] >= 0
    assert r["latency_ms"] >= r["queue_wait_ms"]


def test_infer_deadline_expires_while_queued(single):
    single.wait_idle()
    blocker = RawStream(single, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                    "max_tokens": 200, "stream": True, **FIXED})
    try:
        blocker.first_token()
        status, _, r = post(single, "/infer", {"payload": "Hi", "max_new_tokens": 20, "deadline_ms": 200}).parsed()
        still_busy = single.engine.slot_mailboxes() != [-1]
    finally:
        blocker.close()
    assert status == 200, r
    assert r["finish_reason"] == "deadline" and r["tokens"] == 0 and r["text"] == ""
    assert still_busy  # the blocker held the only slot the whole time: it expired in the queue
    single.wait_idle()


def test_a_deadline_that_passes_during_the_first_step_gets_no_token(single):
    """``deadline_ms`` 1 to 5 returned one token with ``finish_reason:
    "deadline"`` (the deadline was checked before a step, and the step that prefilled the prompt
    published a token made after it). Nothing is published past a deadline."""
    single.wait_idle()
    for ms in (1, 5):
        status, _, r = post(single, "/infer", {"payload": "Write a long story about the sea.", "max_new_tokens": 20,
                                               "deadline_ms": ms}).parsed()
        assert status == 200 and r["finish_reason"] == "deadline" and r["tokens"] == 0, (ms, r)
    single.wait_idle()


@pytest.mark.parametrize("priority", ["urgent", 1, "", ["high"]])
def test_infer_bad_priority(server, priority):
    status, headers, r = post(server, "/infer", {"payload": "Hi", "max_new_tokens": 2, "priority": priority}).parsed()
    assert status == 400 and headers["content-type"].startswith("application/json")
    err = assert_error_shape(r, "invalid_request_error")
    assert err["param"] == "priority"


# -- /health ---------------------------------------------------------------------------------------
def test_health(server):
    status, _, body = get(server, "/health").parsed()
    assert status == 200 and body == {"status": "ok"}


# -- start-up errors -------------------------------------------------------------------------------
def _model_cut_at(model_path: str, tmp_path, size: int) -> str:
    """The bundled model's first ``size`` bytes: a download cut short."""
    path = tmp_path / "cut.gguf"
    with open(model_path, "rb") as f:
        path.write_bytes(f.read(size))
    return str(path)


@pytest.mark.parametrize("flags, needle", [
    (lambda tmp, model: ["--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    (lambda tmp, model: ["--policy", "bogus"], "bogus"),
    (lambda tmp, model: ["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja: "),
    (lambda tmp, model: ["--chat-template", _written(tmp / "t.jinja", "{% for m in messages %}{{ m.content }")],
     "line 1: unexpected '}'"),
    (lambda tmp, model: ["--chat-template", _written(tmp / "t.jinja", "{{ messages | nosuchfilter }}")],
     "No filter named 'nosuchfilter'"),
    (lambda tmp, model: ["--model", _model_cut_at(model, tmp, 100_000)], "its GGUF metadata runs past the end"),
])
def test_startup_error_is_one_line(flags, needle, tmp_path, model_path):
    proc = subprocess.run([sys.executable, "-m", "server.cli", "--port", str(free_port()),
                           *flags(tmp_path, model_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and needle in lines[0]
    assert lines[0].startswith("inference-server:")


def _written(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_model_llama_cpp_refuses_stops_the_server_in_one_line(tmp_path, model_path):
    """Its metadata whole, its tensors cut short: the master starts, fails to load the
    vocabulary for its workers, and the engine fails to load the model. Whichever is first says
    why in one line (the master's tokenizer; the engine: its line, then the master's), the
    master stops with 1, cleaning up; none prints a traceback and the engine is not restarted."""
    import os
    import secrets

    name = f"infer-test-{secrets.token_hex(4)}"
    r = subprocess.run([sys.executable, "-m", "server.cli", "--port", str(free_port()), "--grpc-port", "0",
                        "--workers", "3", "--max-slots", "1", "--max-seq-len", "128",
                        "--model", _model_cut_at(model_path, tmp_path, 8 << 20)],
                       env={**os.environ, "INFERENCE_SHM": name}, capture_output=True, text=True, timeout=120)
    cause = f"RuntimeError: llama.cpp could not load {tmp_path / 'cut.gguf'}"
    tokenizer = re.compile(rf"inference-server: the vocabulary of \S+ cannot be loaded: llama.cpp could not load "
                           rf"{re.escape(str(tmp_path / 'cut.gguf'))} \(llama.cpp's lines above say why\)")
    said = [line[line.index("inference-server:"):] for line in r.stderr.splitlines() if "inference-server:" in line]
    # The master names the engine by its model's id, read from the (intact) GGUF metadata.
    master = re.compile(r"inference-server: the engine of \S+ cannot load its model \(its line above says why\); "
                        r"stopping")
    engine = [line.split(" engine ERROR ", 1)[1] for line in r.stderr.splitlines() if " engine ERROR " in line]
    assert r.returncode == 1 and len(said) == 1, r.stderr[-3000:]
    assert tokenizer.fullmatch(said[0]) or master.fullmatch(said[0]), r.stderr[-3000:]
    assert engine in ([], [f"the engine cannot start: {cause}"]), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "HaltServer" not in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}.d")


def test_chunked_request_body_within_the_limit(server):
    body = json.dumps({"prompt": "Hi", "max_tokens": 3, "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=iter([body[:10], body[10:]]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, reply
    assert reply["usage"]["completion_tokens"] <= 3


def test_a_failed_bind_leaves_no_shared_memory():
    """The engine and its segment start only once gunicorn has bound the port."""
    import os
    import secrets

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        name = f"infer-test-{secrets.token_hex(4)}"
        r = subprocess.run([sys.executable, "-m", "server.cli", "--port", str(taken.getsockname()[1]),
                            "--grpc-port", "0", "--workers", "1"], env={**os.environ, "INFERENCE_SHM": name},
                           capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}.d")


def test_an_app_that_cannot_be_imported_stops_the_start_and_leaves_nothing(tmp_path):
    """The master imports the workers' app module once the engine is starting (here a dependency
    that raises on import: a broken install); it stops what it started and says why in one line,
    leaving no shared memory and no Responses store directory."""
    import os
    import secrets

    (tmp_path / "ujson.py").write_text('raise ImportError("broken on purpose")\n')
    (tmp_path / "tmp").mkdir()
    name = f"infer-test-{secrets.token_hex(4)}"
    env = {**os.environ, "INFERENCE_SHM": name, "PYTHONPATH": str(tmp_path), "TMPDIR": str(tmp_path / "tmp")}
    r = subprocess.run([sys.executable, "-m", "server.cli", "--port", "0", "--grpc-port", "0", "--workers", "1",
                        "--max-slots", "1", "--max-seq-len", "128"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "inference-server: cannot import the app: ImportError: broken on purpose" in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}.d")
    assert not list((tmp_path / "tmp").iterdir())
