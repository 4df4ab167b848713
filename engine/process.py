"""Entry point of the engine process: ``python -m engine.process <transport> <config-json>``.

Started (and restarted) by :class:`engine.supervisor.EngineSupervisor`. It attaches the
transport, loads the model, marks itself ready in the control block and runs the loop until
SIGTERM: the generation loop (:class:`engine.core.EngineCore`), or for ``kind`` ``embed`` the
embedding loop (:class:`engine.embed_core.EmbedCore`; :func:`load_engine`). It dies with its
parent (``PR_SET_PDEATHSIG``) so no engine outlives the server.
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


def load_engine(config: EngineConfig, transport: Transport, backend, adaptive=None):
    """The model and the loop of an engine of ``config`` over ``transport``: a generation
    model (:class:`engine.llama.model.Model`) and :class:`engine.core.EngineCore`, or for kind
    ``embed`` an :class:`engine.llama.embedding.EmbeddingModel` and
    :class:`engine.embed_core.EmbedCore`; ``backend``, ``adaptive`` as
    :func:`engine.llama.backend.detect` and :func:`engine.loop.adaptive_threads` made them. Imports
    llama.cpp (call it in the process that decodes, after its environment is set).

    Returns:
        ``(model, loop)``; the caller closes the model after the loop's :meth:`shutdown`.
    Raises:
        ConfigError: a file that is not GGUF, an embedding model without pooling or whose vector
        does not fit ``max_seq_len``. RuntimeError: llama.cpp refused the model or the context.
    """
    if config.kind == "embed":
        from engine.embed_core import EmbedCore as Loop
        from engine.llama.embedding import EmbeddingModel as Context
    else:
        from engine.core import EngineCore as Loop
        from engine.llama.model import Model as Context
    model = Context.from_config(config, backend)
    try:
        return model, Loop(config, transport, model, adaptive)
    except BaseException:
        model.close()
        raise


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    name, config = argv[0], EngineConfig(**json.loads(argv[1]))
    transport = Transport.attach(name)
    control = transport.control
    control.set_state(EngineState.STARTING, pid=os.getpid())
    # Imported here: llama.cpp (and its OpenMP runtime) must load after the environment the
    # supervisor prepared, and only in this process.
    from engine.llama.backend import detect
    from engine.loop import adaptive_threads

    backend = detect(deterministic=config.deterministic)
    adaptive = adaptive_threads(config, backend)
    try:
        model, core = load_engine(config, transport, backend, adaptive)
    except (ValueError, RuntimeError) as e:  # a file llama.cpp refuses, a size that cannot fit
        # One line, as the server's other start-up errors; FAILED tells the supervisor not to
        # restart (the exit status may be reaped by gunicorn's master first).
        logging.error("the engine cannot start: %s", one_line(e))
        control.set_state(EngineState.FAILED)
        return EXIT_CANNOT_LOAD
    signal.signal(signal.SIGTERM, lambda *_: core.stop())
    # Ctrl-C reaches the whole process group; the supervisor stops the engine (SIGTERM) when
    # the server stops, so the engine outlives no server and no server loses its engine early.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control.set_state(EngineState.READY)
    if config.kind == "embed":
        logging.info("ready: embeddings of %d dimensions; inputs of up to %d tokens, at most %d inputs and %d tokens "
                     "a batch; %d threads, %s backend, weights %s", model.n_embd, config.max_seq_len, config.max_slots,
                     config.n_batch, config.threads, model.backend.name, model.path)
    else:
        logging.info("ready: %d slots x %d tokens, policy %s, %d threads, %s backend, weights %s",
                     config.max_slots, config.max_seq_len, config.policy, config.threads, model.backend.name,
                     model.path)
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
