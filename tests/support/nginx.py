"""The shipped load balancer, ``docker/nginx/nginx.conf.template``, filled in by the shipped
``docker/nginx/render.sh`` (the recipe of docs/operations.md, "Load balancing") and run in front
of real replicas (``tests/support/servers.py``'s ``RunningServer``), for
``tests/e2e/test_multinode.py`` and ``python -m bench.multinode``.

render.sh substitutes only the template's own ``${NAME}`` placeholders (``envsubst`` with an
explicit list, from Debian's gettext-base) and writes one ``server`` line per replica; nginx runs
from Debian's package (``.ci/run`` installs both).
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from tests.support.servers import free_port

TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "docker" / "nginx" / "nginx.conf.template"
RENDER = TEMPLATE.parent / "render.sh"

NO_NGINX = ("no nginx or no envsubst: install Debian's nginx and gettext-base packages (`apt-get install nginx "
            "gettext-base`, as .ci/run does) to run the load-balancer test, which starts the shipped "
            "docker/nginx/nginx.conf.template, filled by docker/nginx/render.sh")

#: the balancing methods the template's ``${BALANCE}`` takes (docs/operations.md, "Load balancing")
LEAST_CONN, AFFINITY = "least_conn", "hash $affinity consistent"
#: seconds a replica gets no request after it failed one (the template's ``fail_timeout``)
FAIL_TIMEOUT_S = float(re.search(r"fail_timeout=(\d+)s", TEMPLATE.read_text())[1])


def nginx_executable() -> str | None:
    """Debian installs nginx in /usr/sbin, which a user's PATH may lack."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


needs_nginx = pytest.mark.skipif(nginx_executable() is None or shutil.which("envsubst") is None, reason=NO_NGINX)


def placeholders() -> set[str]:
    """The template's ``${NAME}`` placeholders, comments left out: ``REPLICA`` and
    ``REPLICA_GRPC`` (one line per replica) and the variables render.sh substitutes."""
    code = "\n".join(line for line in TEMPLATE.read_text().splitlines() if not line.lstrip().startswith("#"))
    return set(re.findall(r"\$\{(\w+)\}", code))


def nginx_variables(text: str) -> set[str]:
    """nginx's own ``$variables`` that ``text`` uses (lower-case names; comments left out)."""
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return set(re.findall(r"\$([a-z_][a-z0-9_]*)", code))


def render(replicas: list[str], replicas_grpc: list[str] | None = None, **variables: str) -> str:
    """The configuration render.sh writes for ``replicas`` (HTTP ``host:port`` each) and
    ``replicas_grpc``, with ``variables`` (LISTEN_HTTP, LISTEN_GRPC, BALANCE, MAX_BODY_BYTES) in
    its environment. Raises AssertionError with render.sh's message when it refuses them."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("REPLICAS", "REPLICAS_GRPC", "LISTEN_HTTP", "LISTEN_GRPC", "BALANCE", "MAX_BODY_BYTES")}
    env["REPLICAS"] = " ".join(replicas)
    if replicas_grpc is not None:
        env["REPLICAS_GRPC"] = " ".join(replicas_grpc)
    out = subprocess.run([str(RENDER)], env={**env, **variables}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


class Nginx:
    """nginx from the shipped template, filled by render.sh, in front of ``replicas`` (any number;
    one listed twice gets two ``server`` lines), listening on 127.0.0.1 (``port`` for HTTP,
    ``grpc_port``).

    ``replicas``: objects with ``host``, ``port`` and ``grpc_port`` (``RunningServer``).
    Raises AssertionError with nginx's message when ``nginx -t`` refuses the filled template.
    """

    def __init__(self, replicas, balance: str = LEAST_CONN, max_body_bytes: int = 1_048_576):
        self.port, self.grpc_port = free_port(), free_port()
        text = render([f"{r.host}:{r.port}" for r in replicas],
                      [f"{r.host}:{r.grpc_port or free_port(r.host)}" for r in replicas],
                      LISTEN_HTTP=f"127.0.0.1:{self.port}", LISTEN_GRPC=f"127.0.0.1:{self.grpc_port}",
                      BALANCE=balance, MAX_BODY_BYTES=str(max_body_bytes))
        self.prefix = tempfile.mkdtemp(prefix="nginx-")
        os.chmod(self.prefix, 0o755)  # run as root, nginx's workers are another user
        self.conf = os.path.join(self.prefix, "nginx.conf")
        with open(self.conf, "w") as f:
            f.write(text)
        self.log = os.path.join(self.prefix, "nginx.log")  # access log (stdout) and error log (stderr)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        try:
            check = self.run("-t")
            assert check.returncode == 0, check.stdout + check.stderr
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(self.command("-g", "daemon off;"), stdout=out, stderr=subprocess.STDOUT)
            self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def command(self, *args: str) -> list[str]:
        """nginx's command line for this prefix and configuration, then ``args``."""
        return [nginx_executable(), "-p", self.prefix, "-c", self.conf, "-e", "stderr", *args]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """Run nginx once with ``args`` (``-t``: check the configuration); its output as text."""
        return subprocess.run(self.command(*args), capture_output=True, text=True)

    def _wait_listening(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        for port in (self.port, self.grpc_port):
            while True:
                assert self.proc.poll() is None, "nginx exited:\n" + open(self.log).read()
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < end, "nginx did not listen:\n" + open(self.log).read()
                    time.sleep(0.02)

    def requests(self) -> list[dict]:
        """The access log so far, a dict per request: ``request`` (method and path),
        ``status``, ``upstreams`` (each replica tried, in order: more than one is a retry),
        ``upstream_statuses`` and ``conversation`` (its X-Conversation-ID, or "-")."""
        pattern = re.compile(r'"(?P<request>[^"]*)" (?P<status>\d+) .*upstream="(?P<up>[^"]*)" '
                             r'upstream_status="(?P<us>[^"]*)" conversation="(?P<conversation>[^"]*)"')
        def tried(field: str) -> list[str]:  # nginx writes "a, b" for a retry, "a : b" for a redirect
            return re.split(r"\s*[,:]\s+", field) if field != "-" else []
        with open(self.log) as f:
            matches = [pattern.search(line) for line in f]
        return [{"request": m["request"], "status": int(m["status"]), "upstreams": tried(m["up"]),
                 "upstream_statuses": tried(m["us"]), "conversation": m["conversation"]} for m in matches if m]

    def logged(self, prefix: str, n: int, timeout: float = 10.0) -> list[dict]:
        """The access-log entries of the ``n`` requests whose X-Conversation-ID starts with
        ``prefix``, in the order they ended; nginx writes an entry just after its response ends,
        so this waits up to ``timeout`` seconds for them. Raises AssertionError when they are not
        ``n``."""
        end = time.monotonic() + timeout
        while len(entries := [r for r in self.requests() if r["conversation"].startswith(prefix)]) < n:
            assert time.monotonic() < end, entries
            time.sleep(0.02)
        assert len(entries) == n, entries
        return entries

    def stop(self) -> None:
        """Stop nginx (fast shutdown) and remove its prefix folder, log included."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # nginx's fast shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.prefix, ignore_errors=True)
