"""The benchmarks use the bundled model's fixtures (tests/support/model.py)."""
from tests.support.model import chat, model_path, tokenizer  # noqa: F401 - pytest fixtures
