"""Entry point of the engine process: ``python -m engine.process <transport> <config-json>``.

Started (and restarted) by :class:`engine.supervisor.EngineSupervisor`. It attaches the
transport, loads the model, marks itself ready in the control block and runs the loop until
SIGTERM. It dies with its parent (``PR_SET_PDEATHSIG``) so no engine outlives the server.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys

from engine.config import EngineConfig, one_line
from shm import EngineState, ErrorCode
from shm.transport import Transport

PR_SET_PDEATHSIG = 1
#: The engine's exit status when the model cannot be loaded.
EXIT_CANNOT_LOAD = 3


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    name, config = argv[0], EngineConfig(**json.loads(argv[1]))
    transport = Transport.attach(name)
    control = transport.control
    control.set_state(EngineState.STARTING, pid=os.getpid())
    # Imported here: llama.cpp (and its OpenMP runtime) must load after the environment the
    # supervisor prepared, and only in this process.
    from engine.core import EngineCore, adaptive_threads
    from engine.llama.backend import detect
    from engine.llama.model import Model

    backend = detect(deterministic=config.deterministic)
    adaptive = adaptive_threads(config, backend)
    try:
        model = Model.from_config(config, backend)
    except (ValueError, RuntimeError) as e:  # a file llama.cpp refuses, a size that cannot fit
        # One line, as the server's other start-up errors; FAILED tells the supervisor not to
        # restart (the exit status may be reaped by gunicorn's master first).
        logging.error("the engine cannot start: %s", one_line(e))
        control.set_state(EngineState.FAILED)
        return EXIT_CANNOT_LOAD
    core = EngineCore(config, transport, model, adaptive)
    signal.signal(signal.SIGTERM, lambda *_: core.stop())
    # Ctrl-C reaches the whole process group; the supervisor stops the engine (SIGTERM) when
    # the server stops, so the engine outlives no server and no server loses its engine early.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control.set_state(EngineState.READY)
    logging.info("ready: %d slots x %d tokens, policy %s, %d threads, %s backend, weights %s",
                 config.max_slots, config.max_seq_len, config.policy, config.threads, model.backend.name, model.path)
    state = EngineState.DEAD
    try:
        core.run()
        state = EngineState.STOPPED  # the loop ended because we were told to stop
    finally:
        control.set_state(EngineState.DEAD)
        core.shutdown(ErrorCode.SHUTDOWN)
        model.close()
        control.set_state(state)
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
