"""The engine inside the calling process: a real transport and :class:`EngineCore` stepping in a
thread (as vLLM's ``InprocClient``), for contract tests that need the model but no processes."""
from __future__ import annotations

import os
import threading

from engine.client import EngineClient
from engine.config import EngineConfig
from shm import EngineState, ErrorCode
from shm.transport import Transport
from shm.wakeup import Wakeups


class InprocEngine:
    """Loads the model here and steps it in a daemon thread; :attr:`client` talks to it through
    the same shared memory a separate engine process would use. Use as a context manager.

    Raises:
        ConfigError: unreadable model file. RuntimeError: llama.cpp refused the model.
    """

    def __init__(self, config: EngineConfig):
        from engine.core import EngineCore, adaptive_threads  # llama.cpp loads only where an engine runs
        from engine.llama.backend import detect
        from engine.llama.model import Model

        self.transport = Transport.create(config.layout())
        try:
            backend = detect(deterministic=config.deterministic)
            adaptive = adaptive_threads(config, backend)
            self.model = Model.from_config(config, backend)
        except BaseException:
            self.transport.close()
            raise
        self.core = EngineCore(config, self.transport, self.model, adaptive)
        self.transport.control.set_state(EngineState.READY, pid=os.getpid())
        self._thread = threading.Thread(target=self.core.run, name="inproc-engine", daemon=True)
        self._thread.start()
        self.client = EngineClient(self.transport)

    def close(self) -> None:
        """Stop the loop, fail what is left, free the model, unlink the transport."""
        self.core.stop()
        self.transport.wakeups.wake(Wakeups.ENGINE)
        self._thread.join()
        self.core.shutdown(ErrorCode.SHUTDOWN)
        self.transport.control.set_state(EngineState.STOPPED)
        self.model.close()
        self.transport.close()

    def __enter__(self) -> "InprocEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
