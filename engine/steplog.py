"""Engine step records: one JSON line per engine step that sampled or cancelled anything.

Off by default (``--step-log PATH``); for debugging and for tests that check what the engine
did, step by step, rather than what the front ends saw. A line::

    {"step": 812, "t": 5321.0412, "sampled": [[3, 97], [5, 101]], "cancelled": [[7, 99]]}

``t`` is ``time.monotonic()`` at the step's start (one clock for every process of the machine);
``sampled`` lists the ``[mailbox, lease]`` of every sequence that sampled a token in the step,
``cancelled`` those the step found cancelled by their client (waiting or running) and finished.
A lease is unique for the transport's life, so a line never mixes two requests.
"""
from __future__ import annotations

import json


class StepLog:
    """Appends step records to ``path`` (line-buffered: a killed engine loses at most a line)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    def write(self, step: int, t: float, sampled: list[tuple[int, int]], cancelled: list[tuple[int, int]]) -> None:
        """Record one step; nothing when it neither sampled nor cancelled (idle steps)."""
        if sampled or cancelled:
            self._file.write(json.dumps({"step": step, "t": round(t, 6),
                                         "sampled": [[int(m), int(lease)] for m, lease in sampled],
                                         "cancelled": [[int(m), int(lease)] for m, lease in cancelled]}) + "\n")

    def close(self) -> None:
        self._file.close()
