"""The bundled model's fixtures, shared by the tests' and the benches' conftest.py: its path, its
tokenizer and its chat template, each loaded once a session."""
from __future__ import annotations

import pytest

from engine.config import default_model_path


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from engine.llama.tokenizer import Tokenizer
    return Tokenizer(model_path)


@pytest.fixture(scope="session")
def chat(tokenizer):
    from server.text.chat_template import ChatTemplate
    return ChatTemplate(tokenizer)
