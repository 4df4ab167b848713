"""LiteLLM Proxy in front of an OpenAI-compatible upstream, with per-key limits and no database.

:func:`litellm_proxy` starts ``litellm --config config.yaml`` (one uvicorn worker) in front of one
upstream (e.g. ``llama-server``) and gives each named key its own ``max_parallel_requests`` /
``rpm_limit`` / ``tpm_limit``, the limits LiteLLM's virtual keys carry.

Why custom auth instead of virtual keys: ``/key/generate`` needs PostgreSQL through prisma, and
prisma's query engine binary cannot be downloaded here (binaries.prisma.sh is unreachable), so the
proxy runs without a DB and ``/key/generate`` answers "DB not connected". LiteLLM's documented
custom auth (``general_settings: custom_auth: <module>.<function>``, an async
``(request, api_key) -> UserAPIKeyAuth``) replaces the key lookup: the function written here
returns ``UserAPIKeyAuth(api_key=..., max_parallel_requests=..., rpm_limit=..., tpm_limit=...)``
for a known key and raises 401 otherwise. The proxy's parallel request limiter
(``litellm/proxy/hooks/parallel_request_limiter_v3.py``, ``create_rate_limit_descriptors``) reads
those fields from the returned object, exactly as for a DB key, and keeps its counters in the
in-memory cache when no Redis is configured. Over a limit it answers 429 at once (nothing is
queued; ``Retry-After: 60`` even for ``max_parallel_requests``): ``max_parallel_requests`` counts
requests in flight (a stream holds its slot until it ends or the client disconnects),
``rpm_limit`` / ``tpm_limit`` count over a one-minute window; ``tpm_limit`` reserves an estimate
(prompt + ``max_tokens``) at admission and settles it with the reported usage after.

Its cost, measured here (one worker, streamed chats against llama-server, 2026-12-06): about
20 ms more to the first token, and about 25 ms of CPU a request plus 1.5 ms a streamed chunk,
on the cores the upstream computes on.

Install (tried with litellm 1.108.7)::

    python3 -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install 'litellm[proxy]'

Settings that matter:

- env ``LITELLM_LOCAL_MODEL_COST_MAP=True``: use the bundled pricing map instead of fetching it;
- env ``LITELLM_LOG=ERROR``: no per-request logging (uvicorn's access log is off too);
- ``--host 127.0.0.1``; no ``database_url``; a random ``master_key`` (it refuses to start without
  one) that custom auth, which runs before the master key check, never accepts;
- ``litellm_params.model: openai/<model>``: LiteLLM forwards request fields it does not know
  (``ignore_eos``, llama-server's extension) to an OpenAI-compatible upstream in ``extra_body``;
  ``drop_params`` must stay off. ``stream_options: {include_usage: true}`` passes through, so the
  final usage chunk arrives (LiteLLM rewrites it: ``choices`` is ``[{"index": 0, "delta": {}}]``,
  not ``[]``, and ``model`` is the proxy's model name).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request

DEFAULT_BIN = "/tmp/litellm-venv/bin/litellm"

_AUTH_MODULE = '''\
import json, os
from fastapi import HTTPException
from litellm.proxy._types import UserAPIKeyAuth

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "keys.json")) as f:
    KEYS = json.load(f)  # key value -> {"key_alias": name, "max_parallel_requests": ..., ...}


async def user_api_key_auth(request, api_key):
    entry = KEYS.get(api_key)
    if entry is None:
        raise HTTPException(status_code=401, detail="unknown key")
    return UserAPIKeyAuth(api_key=api_key, **entry)
'''


def _bin() -> str:
    return os.environ.get("LITELLM_BIN", DEFAULT_BIN)


def available() -> bool:
    """Whether the ``litellm`` executable (``$LITELLM_BIN`` or :data:`DEFAULT_BIN`) is there."""
    return os.access(_bin(), os.X_OK)


@contextlib.contextmanager
def litellm_proxy(upstream_url: str, model: str, keys: dict[str, dict], timeout_s: float = 90):
    """LiteLLM Proxy serving ``model`` from ``upstream_url`` (an OpenAI base URL, ``.../v1``).

    ``keys`` maps a name to that key's limits, e.g. ``{"a": {"max_parallel_requests": 8},
    "b": {"rpm_limit": 60}, "free": {}}``. Yields ``(base_url, {name: key_value})`` once the proxy
    answers; send the key as ``Authorization: Bearer <key_value>``. It is terminated after.

    Raises:
        RuntimeError: it exited or did not answer within ``timeout_s`` (with its log's tail).
    """
    from tests.support.servers import free_port

    values = {name: "sk-" + secrets.token_hex(16) for name in keys}
    table = {values[name]: {"key_alias": name, **limits} for name, limits in keys.items()}
    config = {
        "model_list": [{"model_name": model, "litellm_params": {
            "model": f"openai/{model}", "api_base": upstream_url, "api_key": "none"}}],
        # The proxy refuses to start without a master key; custom auth runs first and never
        # accepts this random one.
        "general_settings": {"custom_auth": "custom_auth.user_api_key_auth",
                             "master_key": "sk-" + secrets.token_hex(32)},
        "litellm_settings": {"drop_params": False},
    }
    tmp = tempfile.mkdtemp(prefix="litellm-proxy-")
    proc = None
    try:
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            json.dump(config, f, indent=1)  # JSON is YAML
        with open(os.path.join(tmp, "keys.json"), "w") as f:
            json.dump(table, f)
        with open(os.path.join(tmp, "custom_auth.py"), "w") as f:
            f.write(_AUTH_MODULE)
        port = free_port()
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        log = open(os.path.join(tmp, "proxy.log"), "wb")
        with log:
            proc = subprocess.Popen([_bin(), "--config", "config.yaml", "--host", "127.0.0.1",
                                     "--port", str(port)], cwd=tmp, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(tmp, "proxy.log"), "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
                what = "exited" if proc.poll() is not None else "did not answer"
                raise RuntimeError(f"litellm proxy {what}: {tail}")
            try:
                with urllib.request.urlopen(base_url + "/health/liveliness", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.3)
        yield base_url, values
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
