"""The shipped load balancer, ``docker/nginx/nginx.conf.template``, filled in and run in front of
real replicas (``tests/support/servers.py``'s ``RunningServer``), for ``tests/e2e/test_multinode.py`` and
``python -m bench.multinode``.

The template's ``${NAME}`` placeholders are what the nginx image's entrypoint fills with
envsubst; here they are filled the same way (``string.Template``, which leaves nginx's own
lower-case ``$variables`` alone), and nginx runs from Debian's package (``.ci/run`` installs it).
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import string
import subprocess
import tempfile
import time

import pytest

from tests.support.servers import free_port

TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "docker" / "nginx" / "nginx.conf.template"

NO_NGINX = ("no nginx: install Debian's nginx package (`apt-get install nginx`, as .ci/run does) to run the "
            "load-balancer test, which starts the shipped docker/nginx/nginx.conf.template")

#: the balancing methods the template's ``${BALANCE}`` takes (docs/operations.md, "Load balancing")
LEAST_CONN, AFFINITY = "least_conn", "hash $affinity consistent"
#: seconds a replica gets no request after it failed one (the template's ``fail_timeout``)
FAIL_TIMEOUT_S = float(re.search(r"fail_timeout=(\d+)s", TEMPLATE.read_text())[1])


def nginx_executable() -> str | None:
    """Debian installs nginx in /usr/sbin, which a user's PATH may lack."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


needs_nginx = pytest.mark.skipif(nginx_executable() is None, reason=NO_NGINX)


def placeholders() -> set[str]:
    """The names the template needs filled (the variables compose must give the nginx service)."""
    return set(re.findall(r"\$\{(\w+)\}", TEMPLATE.read_text()))


def render(variables: dict[str, str]) -> str:
    """The template with every placeholder filled. Raises KeyError naming one left unfilled."""
    missing = placeholders() - set(variables)
    if missing:
        raise KeyError(f"placeholders not filled: {sorted(missing)}")
    return string.Template(TEMPLATE.read_text()).safe_substitute(variables)


class Nginx:
    """nginx from the shipped template in front of three replicas (the template names three: for
    fewer, repeat one), listening on 127.0.0.1 (``port`` for HTTP, ``grpc_port``).

    ``replicas``: objects with ``host``, ``port`` and ``grpc_port`` (``RunningServer``).
    Raises AssertionError with nginx's message when ``nginx -t`` refuses the filled template.
    """

    def __init__(self, replicas, balance: str = LEAST_CONN, max_body_bytes: int = 1_048_576):
        assert len(replicas) == 3, "the template names three replicas"
        self.prefix = tempfile.mkdtemp(prefix="nginx-")
        os.chmod(self.prefix, 0o755)  # run as root, nginx's workers are another user
        self.port, self.grpc_port = free_port(), free_port()
        variables = {"LISTEN_HTTP": f"127.0.0.1:{self.port}", "LISTEN_GRPC": f"127.0.0.1:{self.grpc_port}",
                     "BALANCE": balance, "MAX_BODY_BYTES": str(max_body_bytes)}
        for i, r in enumerate(replicas, 1):
            variables[f"REPLICA_{i}"] = f"{r.host}:{r.port}"
            variables[f"REPLICA_{i}_GRPC"] = f"{r.host}:{r.grpc_port or free_port(r.host)}"
        self.conf = os.path.join(self.prefix, "nginx.conf")
        with open(self.conf, "w") as f:
            f.write(render(variables))
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
