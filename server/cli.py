"""``inference-server``: shared memory, the engine process and gunicorn, from one command.

Flags override environment variables (``inference-server --help`` lists both). The flags are
turned into the environment that ``server.gunicorn_conf`` and ``server.wsgi`` read, so running
gunicorn by hand with that config module behaves the same. SIGTERM drains (docs/operations.md
"Stopping and draining"), Ctrl-C stops at once; either way every process stops and the shared memory is
unlinked.
"""
from __future__ import annotations

import os
import sys

from engine.config import ConfigError


def main(argv=None) -> int:
    from server.config import from_args

    try:
        config = from_args(argv)
        config.check_files()
        config.check_memory()
    except ConfigError as e:
        print(f"inference-server: {e}", file=sys.stderr)
        return 2
    for name in ("MODEL_PATH", "MODEL_ID", "CHAT_TEMPLATE", "MODELS_FILE"):  # one way of declaring models
        os.environ.pop(name, None)
    os.environ.update(config.to_env())
    if not config.models_file:  # the models as resolved (the bundled one by default), for every process
        os.environ["MODEL_PATH"] = os.pathsep.join(spec.path for spec in config.models)
    from gunicorn.app.wsgiapp import WSGIApplication

    sys.argv = ["inference-server", "-c", "python:server.gunicorn_conf", "server.wsgi:app"]
    WSGIApplication("%(prog)s [OPTIONS]").run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
