"""The clients people point at local servers, asking for structured output from the shared real
server: the OpenAI SDK's ``chat.completions.parse`` with a Pydantic model, LangChain's
``with_structured_output`` (its default method, ``json_schema``, and ``json_mode``), and
LiteLLM's ``completion(response_format=...)``. Greedy; each answer must parse into the model."""
from __future__ import annotations

import json
import os

import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "local-model"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)


ASK = [{"role": "user", "content": "Describe Paris as JSON with name, country and population."}]


def test_openai_sdk_parse_with_a_pydantic_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, temperature=0,
                                               max_tokens=96)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and message.refusal is None
    assert City.model_validate_json(message.content) == message.parsed


def _langchain(server):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=server.url + "/v1", api_key="x", model=MODEL, temperature=0, max_tokens=96,
                      max_retries=0, timeout=120)


def test_langchain_with_structured_output_default_method(server):
    city = _langchain(server).with_structured_output(City).invoke(ASK)  # json_schema, strict
    assert isinstance(city, City)


def test_langchain_with_structured_output_json_mode(server):
    schema = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string"}}}
    answer = _langchain(server).with_structured_output(schema, method="json_mode").invoke(
        [{"role": "user", "content": "Answer in JSON: what is the capital of France?"}])
    assert isinstance(answer, dict)  # json_object: any JSON object, parsed


def test_litellm_completion_with_response_format(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list at import
    monkeypatch.setenv("LITELLM_TELEMETRY", "False")
    import litellm
    reply = litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="x", messages=ASK,
                               response_format=City, temperature=0, max_tokens=96, num_retries=0, timeout=120)
    assert reply.choices[0].finish_reason == "stop"
    City.model_validate(json.loads(reply.choices[0].message.content))
