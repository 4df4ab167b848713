"""The README's and docs/'s examples are tests: every curl command of their shell blocks and the
README's OpenAI SDK snippet run against a real server, and the tenant-file examples of
docs/tenants.md load, all extracted from the pages themselves, so the first thing a new user
copies cannot rot. Which shell blocks run: docs/development.md (checked in tests/spec/test_docs.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.tenancy.tenants import Tenants
from tests.support.docs import EXAMPLE_URL, README, ROOT, blocks, curl_commands

BLOCKS = blocks(README)
TENANTS_PAGE = ROOT / "docs/tenants.md"


def test_the_readme_has_the_examples_this_file_runs():
    assert len([c for b in BLOCKS if b.runnable for c in b.commands()]) >= 3
    assert any(b.lang == "python" and "OpenAI(" in b.code for b in BLOCKS)
    assert any(c.endswith("/metrics") for c in curl_commands())  # docs/metrics.md
    langs = [b.lang for b in blocks(TENANTS_PAGE)]
    assert langs.count("json") >= 1 and langs.count("toml") >= 1


@pytest.mark.parametrize("command", curl_commands())
def test_curl_example(server, command):
    out = subprocess.run(["bash", "-c", command.replace(EXAMPLE_URL, server.url) + " -w '\\n%{http_code}'"],
                         capture_output=True, text=True, timeout=300)
    body, _, status = out.stdout.rpartition("\n")
    assert out.returncode == 0 and status == "200", (command, out.stdout[-500:], out.stderr)
    if '"stream": true' in command:
        assert body.rstrip().endswith("data: [DONE]")
    elif command.endswith("/metrics"):
        assert "\ninference_kv_slot_utilization{model=" in body
    else:
        reply = json.loads(body)
        assert reply.get("error") is None and (reply.get("choices") or reply.get("output") or reply.get("text"))
    server.wait_idle(60)


def test_openai_sdk_example(server):
    (code,) = [b.code for b in BLOCKS if b.lang == "python" and "OpenAI(" in b.code]
    out = subprocess.run([sys.executable, "-c", code.replace(EXAMPLE_URL, server.url)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    server.wait_idle(60)


def test_tenant_file_examples_load(tmp_path):
    loaded = []
    for b in blocks(TENANTS_PAGE):
        if b.lang in ("json", "toml") and "tenants" in b.code:
            path = tmp_path / f"tenants.{b.lang}"
            path.write_text(b.code)
            loaded.append(Tenants.load(str(path)))
    assert len(loaded) >= 2
    team_a = [t.authenticate("key-a1") for t in loaded]
    assert all(t is not None and t.id == "team-a" and t.weight == 2 for t in team_a)
