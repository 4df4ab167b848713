"""How many times a request's grammar is built by llguidance: a cold chat request with three
tools and a ``json_schema`` format is checked once (its schemas together, in the front end) and
compiled once (by the engine); a repeated one builds nothing. The in-process app (the shared
``app`` fixture) with its checks run in this process, as its child process runs them, so every
llguidance build of the request is counted here."""
from __future__ import annotations

import uuid

import llguidance
import pytest

from server.structured import check as checks
from server.structured.check import CheckedGrammars
from tests.support.http import error, post

CHAT = "/v1/chat/completions"


class _InProcess:
    """The child's answers, computed here (``server/structured/check_child.py`` calls the same)."""

    check = staticmethod(checks.check)
    check_schemas = staticmethod(checks.check_schemas)


@pytest.fixture
def builds(app, monkeypatch):
    """Every llguidance grammar build in this process (``LLMatcher`` made or a grammar
    validated), the engine's compiles included, while the front end checks here."""
    seen, real = [], llguidance.LLMatcher

    class Counting:
        def __call__(self, *args, **kwargs):
            seen.append("matcher")
            return real(*args, **kwargs)

        def validate_grammar(self, *args, **kwargs):
            seen.append("validate")
            return real.validate_grammar(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)
    app.wait_idle()
    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    monkeypatch.setattr(app.generator, "grammars", CheckedGrammars(checker=_InProcess()))
    yield seen
    app.wait_idle()


def _body(tag: str, **tool_parameters) -> dict:
    """Three tools and a JSON schema format no request built before (``tag``)."""
    def tool(i: int) -> dict:
        parameters = tool_parameters.get(f"p{i}", {"type": "object", "properties": {tag: {"type": "integer"}}})
        return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}
    schema = {"type": "object", "properties": {"answer": {"type": "string"}, tag: {"type": "integer"}},
              "required": ["answer"]}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [tool(i) for i in range(3)],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}


def test_a_cold_request_with_tools_and_a_schema_builds_its_grammar_twice(app, builds):
    body = _body(f"k{uuid.uuid4().hex[:8]}")
    r = post(app, CHAT, body)
    assert r.status == 200, r.body
    assert len(builds) == 2, builds  # one check (the four schemas together), one compile in the engine
    builds.clear()
    assert post(app, CHAT, body).status == 200
    assert builds == []  # the tenant's verdict and compiled grammar are kept


@pytest.mark.parametrize("fault,param", [
    ({"p2": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "tools[2].function.parameters"),
    ({"p1": {"$ref": "#"}}, "tools[1].function.parameters"),
    ({"format": {"type": "array", "uniqueItems": True}}, "response_format.json_schema.schema"),
])
def test_each_schema_checked_together_is_refused_by_its_own_field(app, builds, fault, param):
    body = _body(f"k{uuid.uuid4().hex[:8]}", **{k: v for k, v in fault.items() if k != "format"})
    if "format" in fault:
        body["response_format"]["json_schema"]["schema"] = fault["format"]
    err = error(post(app, CHAT, body), 400, param=param)
    assert "cannot be enforced" in err["message"] and "%json" not in err["message"], err
