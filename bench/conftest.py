"""The benchmarks use the tests' fixtures for the bundled model."""
from tests.conftest import chat, model_path, tokenizer  # noqa: F401 - pytest fixtures
