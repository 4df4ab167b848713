"""The engine request's record (engine/request.py): its kind in the fixed part, ``logit_bias``
in a bounded variable section, a request needing more room than the bound refused naming the field."""
from __future__ import annotations

import numpy as np
import pytest

from engine.request import EngineRequest, Priority, SamplingParams

HIGH = Priority.HIGH


def test_request_record_carries_kind_and_a_bounded_variable_section():
    """logit_bias travels in the record's variable section; the kind in the fixed part; a
    request needing more room than the server's bound is refused naming the field."""
    from engine.errors import InvalidRequest
    from engine.request import RequestKind, extras_room, record_bytes

    params = SamplingParams(max_new_tokens=4, logit_bias=((5, -100), (7, 2.5)), stop_ids=(9,))
    request = EngineRequest(np.array([1, 2, 3], np.int32), params, HIGH, 0.0, 3, 2.0, RequestKind.SCORE)
    payload = np.zeros(record_bytes(16, 64), np.uint8)
    assert extras_room(len(payload), 16) == 64
    request.resolved(16, 64).encode(payload, 16)
    back = EngineRequest.decode(payload, 16)
    assert back.kind == RequestKind.SCORE and back.tenant == 3 and back.prompt.tolist() == [1, 2, 3]
    assert back.sampling == params and back.sampling.logit_bias == ((5, -100.0), (7, 2.5))
    plain = EngineRequest(np.array([1], np.int32), SamplingParams(max_new_tokens=1))
    assert plain.extras() == b"" and plain.resolved(16, 0) is plain  # no blob: no room needed
    with pytest.raises(InvalidRequest) as e:
        request.resolved(16, 8)
    assert e.value.param == "logit_bias" and "--max-request-extras-bytes" in str(e.value)
    for bad in (((1, 101),), ((-1, 0),), ((1.5, 0),)):
        with pytest.raises(InvalidRequest):
            SamplingParams(logit_bias=bad)
