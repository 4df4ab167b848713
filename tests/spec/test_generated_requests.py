"""schemathesis' requests from both OpenAPI documents against real servers
(``tests/spec/generated_requests.py``), in a pytest of their own: so that every operation runs (under
xdist one did per test) and only the worker that runs them builds their cases (that module's
docstring says more)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Operations tested: this server's document (26 positive, 3 of them streamed too, 6 POST routes
#: negative; its 27 Admin API and admin page operations against a server with an admin key;
#: /v1/embeddings positive and negative against an embedding model) and OpenAI's (8, 26 of its
#: Admin API document, and its /embeddings).
OPERATIONS = 99


def test_generated_requests_conform():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/spec/generated_requests.py"]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-3000:]
    summary = run.stdout.splitlines()[-1]  # every operation of both documents ran, and passed
    assert summary.startswith(f"{OPERATIONS} passed"), run.stdout[-3000:]
