"""The backend profile (engine/llama/backend.py) follows the device llama.cpp reports (faked
here: nothing has run on a GPU), and ``--deterministic`` is refused where it cannot hold."""
from __future__ import annotations

import pytest

from engine.config import ConfigError


def test_backend_profile_follows_the_device_llama_cpp_reports():
    from engine.llama import backend

    assert backend.detect(lambda: True) is backend.GPU and backend.detect(lambda: False) is backend.CPU
    assert backend.GPU.n_gpu_layers == -1 and not backend.GPU.adaptive_threads and not backend.GPU.convert_unbatched
    assert backend.CPU.max_chunk_tokens == 512 and backend.CPU.adaptive_threads and backend.CPU.convert_unbatched
    assert backend.CPU_DETERMINISTIC.max_chunk_tokens == 63 and backend.CPU_DETERMINISTIC.batch_invariant
    assert backend.detect() is backend.CPU  # this build has no GPU device
    assert backend.detect(lambda: False, deterministic=True) is backend.CPU_DETERMINISTIC
    with pytest.raises(ConfigError, match="--deterministic"):  # refused, never ignored
        backend.detect(lambda: True, deterministic=True)
