"""The engine inside the calling process: a real transport and its loop (:class:`EngineCore`, or
:class:`EmbedCore` for an embedding model) stepping in a thread (as vLLM's ``InprocClient``), for
contract tests that need the model but no processes."""
from __future__ import annotations

import os
import threading

from engine.client import EngineClient
from engine.config import EngineConfig
from shm import EngineState, ErrorCode
from shm.transport import Transport
from shm.wakeup import Wakeups


class InprocEngine:
    """Loads the model and steps it in a daemon thread; :attr:`client` talks to it through the
    same shared memory a separate engine process would use. Use as a context manager.

    The model loads in the thread that decodes, not in the caller's: llama.cpp's CPU backend
    runs its threads through OpenMP, and libgomp keeps one pool of threads for each thread that
    starts parallel work. Loading here and decoding there made two pools, more threads than
    CPUs, and libgomp then waits at every barrier by sleeping, not spinning: a decode on two
    threads ran at half speed (bench/RESULTS.md, "On an AVX2 machine").

    Raises:
        ConfigError: unreadable model file. RuntimeError: llama.cpp refused the model.
    """

    def __init__(self, config: EngineConfig):
        self.transport = Transport.create(config.layout())
        self.config = config
        self.model = None  # set by the engine thread once loaded
        self._loaded = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load_and_run, name="inproc-engine", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._error is not None:
            self._thread.join()
            self.transport.close()
            raise self._error
        self.client = EngineClient(self.transport)

    def _load_and_run(self) -> None:
        from engine.llama.backend import detect  # llama.cpp loads only where an engine runs
        from engine.loop import adaptive_threads
        from engine.process import load_engine

        try:
            backend = detect(deterministic=self.config.deterministic)
            adaptive = adaptive_threads(self.config, backend)
            self.model, self.core = load_engine(self.config, self.transport, backend, adaptive)
            self.transport.control.set_state(EngineState.READY, pid=os.getpid())
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e
            if self.model is not None:
                self.model.close()
            return
        finally:
            self._loaded.set()
        self.core.run()

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
