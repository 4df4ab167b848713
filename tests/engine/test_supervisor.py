"""The supervisor and an engine that cannot load its model: one line, no restart loop."""
import os

from engine.config import EngineConfig
from engine.supervisor import EngineSupervisor
from tests.support.servers import suite_threads


def test_an_engine_that_cannot_load_its_model_says_why_in_one_line_and_is_not_restarted(tmp_path, model_path, capfd):
    """A download cut short: llama.cpp refuses the file in the engine process. It logs one
    line and marks itself FAILED; the supervisor restarts nothing (the same file would fail
    again, every back-off), and ``wait_ready`` answers False at once instead of after its timeout."""
    cut = tmp_path / "cut.gguf"
    with open(model_path, "rb") as f:
        cut.write_bytes(f.read(8 << 20))
    supervisor = EngineSupervisor.create(suite_threads(EngineConfig(model_path=str(cut), max_slots=1, max_seq_len=128)))
    try:
        supervisor.start()
        assert not supervisor.wait_ready(60)
        assert supervisor.failed and supervisor.restarts == 0
    finally:
        supervisor.stop()
    assert not os.path.exists(f"/dev/shm/{supervisor.transport_name}")
    err = capfd.readouterr().err
    said = [line.split(" engine ERROR ", 1)[1] for line in err.splitlines() if " engine ERROR " in line]
    assert said == [f"the engine cannot start: RuntimeError: llama.cpp could not load {cut}"], err
    assert "Traceback" not in err, err
