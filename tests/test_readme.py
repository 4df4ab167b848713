"""The README's examples are tests: every curl command and the OpenAI SDK snippet run against a
real server, and the tenant-file examples load, all extracted from README.md itself, so the
first thing a new user copies cannot rot."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from server.tenants import Tenants

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, re.M | re.S)
EXAMPLE_URL = "http://127.0.0.1:8080"


def curl_commands() -> list[str]:
    """Each curl command of the README's shell blocks (continuation lines joined)."""
    commands = []
    for lang, code in BLOCKS:
        if lang == "sh":
            joined = code.replace("\\\n", " ")
            commands += [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]
    return commands


def test_the_readme_has_the_examples_this_file_runs():
    assert len(curl_commands()) >= 3
    assert any(lang == "python" and "OpenAI(" in code for lang, code in BLOCKS)
    assert [lang for lang, _ in BLOCKS].count("json") >= 1 and [lang for lang, _ in BLOCKS].count("toml") >= 1


@pytest.mark.parametrize("command", curl_commands())
def test_curl_example(server, command):
    out = subprocess.run(["bash", "-c", command.replace(EXAMPLE_URL, server.url) + " -w '\\n%{http_code}'"],
                         capture_output=True, text=True, timeout=300)
    body, _, status = out.stdout.rpartition("\n")
    assert out.returncode == 0 and status == "200", (command, out.stdout[-500:], out.stderr)
    if '"stream": true' in command:
        assert body.rstrip().endswith("data: [DONE]")
    elif command.endswith("/metrics"):
        assert "\ninference_kv_slot_utilization " in body
    else:
        reply = json.loads(body)
        assert "error" not in reply and (reply.get("choices") or reply.get("text") is not None)
    server.wait_idle(60)


def test_openai_sdk_example(server):
    (code,) = [code for lang, code in BLOCKS if lang == "python" and "OpenAI(" in code]
    out = subprocess.run([sys.executable, "-c", code.replace(EXAMPLE_URL, server.url)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    server.wait_idle(60)


def test_tenant_file_examples_load(tmp_path):
    loaded = []
    for lang, code in BLOCKS:
        if lang in ("json", "toml") and "tenants" in code:
            path = tmp_path / f"tenants.{lang}"
            path.write_text(code)
            loaded.append(Tenants.load(str(path)))
    assert len(loaded) >= 2
    team_a = [t.authenticate("key-a1") for t in loaded]
    assert all(t is not None and t.id == "team-a" and t.weight == 2 for t in team_a)
