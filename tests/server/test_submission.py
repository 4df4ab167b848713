"""A request's submission (``server/generation/submission.py``) through the in-process app (the
shared ``app`` fixture): each prompt is prepared once, whatever its number of choices, and a
refusal names the client's own field from where it is raised."""
from __future__ import annotations

import pytest

from engine.request import EngineRequest
from tests.support.http import error, post


@pytest.fixture
def resolved(monkeypatch):
    """The prompt length of every ``EngineRequest.resolved`` call during a test."""
    seen, real = [], EngineRequest.resolved

    def watched(self, *args, **kwargs):
        seen.append(len(self.prompt))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(EngineRequest, "resolved", watched)
    return seen


def test_each_prompt_is_resolved_once(app, resolved):
    r = post(app, "/v1/completions", {"prompt": ["Hello", "Once upon a time"], "n": 2, "max_tokens": 2,
                                      "temperature": 0})
    assert r.status == 200 and len(r.json()["choices"]) == 4, r.body
    assert len(resolved) == 2 and resolved[0] < resolved[1]  # per prompt, not per choice nor per step


def test_a_prompt_that_cannot_fit_is_refused_naming_the_clients_fields(app, resolved):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    error(post(app, "/v1/chat/completions", {**chat, "max_completion_tokens": 100_000}), 400,
          param="max_completion_tokens", code="context_length_exceeded")
    assert len(resolved) == 1  # refused by EngineRequest.resolved, which named the field
    error(post(app, "/v1/completions", {"prompt": [1] * 600, "max_tokens": 1}), 400,
          param="prompt", code="context_length_exceeded")


def test_a_drain_that_begins_between_a_requests_sequences_serves_them_all(app, monkeypatch):
    """The drain begins right after the first of a request's sequences is in (each choice and
    each embedding input is one): the request is under way and gets every choice; the next
    request is refused with 503."""
    from engine.client import EngineClient

    state, real = {"draining": False}, EngineClient.submit

    def submit(self, *args, **kwargs):
        stream = real(self, *args, **kwargs)
        state["draining"] = True
        return stream
    monkeypatch.setattr(EngineClient, "submit", submit)
    monkeypatch.setattr(EngineClient, "draining", lambda self: state["draining"])
    r = post(app, "/v1/completions", {"prompt": "Hello", "n": 3, "max_tokens": 2, "temperature": 0})
    assert r.status == 200 and len(r.json()["choices"]) == 3, r.body
    error(post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}), 503, code="server_shutting_down")


def test_a_request_under_way_whose_engine_the_drain_stopped_is_told_the_server_is_shutting_down(app, monkeypatch):
    """The drain's timeout stops the engine while a request is still submitting its sequences
    (the later inputs of an embedding request): 503 ``server_shutting_down``, as for the
    sequences the engine ended, not ``engine_unavailable``."""
    from engine.client import EngineClient

    state, real = {"stopped": False}, EngineClient.submit

    def submit(self, *args, **kwargs):
        stream = real(self, *args, **kwargs)
        state["stopped"] = True
        return stream
    monkeypatch.setattr(EngineClient, "submit", submit)
    monkeypatch.setattr(EngineClient, "draining", lambda self: state["stopped"])
    monkeypatch.setattr(EngineClient, "ready", lambda self: not state["stopped"])
    error(post(app, "/v1/completions", {"prompt": "Hello", "n": 3, "max_tokens": 2}), 503,
          code="server_shutting_down")
