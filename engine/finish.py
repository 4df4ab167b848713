"""The finish rule: what a step's outcome does to a sequence, in one function (vLLM v1's
``check_stop``, called from ``Scheduler.update_from_output``; nano-vllm's ``postprocess``).

:func:`finish_of` decides; :meth:`engine.core.EngineCore.sample_and_publish` and
:meth:`engine.core.EngineCore.score` publish and retire as it says. Cancellation, and a deadline
that passed between steps, end a sequence before its step (``EngineCore.expire``); a failed
decode ends its batch with an error.
"""
from __future__ import annotations

from typing import NamedTuple

from engine.sequence import Sequence
from shm import ErrorCode, Finish


class Verdict(NamedTuple):
    """What one step's outcome does to its sequence.

    Attributes:
        finish: how the sequence ends, or ``Finish.NONE`` while it goes on.
        error: the error code of ``Finish.ERROR`` (``ErrorCode.NONE`` otherwise).
        served: the token came in time: the sequence's first-token time is marked with it and
            its tenant charged for it.
        published: the token goes to the sequence's mailbox and its history (it is fed at the
            next step if the sequence goes on).
    """

    finish: Finish
    error: ErrorCode = ErrorCode.NONE
    served: bool = True
    published: bool = True


#: The sequence goes on: its token is served and published.
GOES_ON = Verdict(Finish.NONE)


def finish_of(seq: Sequence, token: int | None, eog: frozenset[int], now: float) -> Verdict:
    """The finish rule, first match wins:

    1. ``token`` None: the step ended the prompt of a sequence that samples nothing (a scoring
       request with ``max_new_tokens`` 0): ``length`` once it has nothing left to generate.
    2. the deadline passed while the step computed: ``deadline``, nothing served or published.
    3. the sequence's grammar failed on the token: an error (``ErrorCode.CONSTRAINT``), the
       token unpublished.
    4. a stop token (``stop_ids``, or end-of-generation unless ``ignore_eos``): ``stop``, the
       token unpublished, except for a scoring request, which reports the token that ended it
       (as vLLM does; lm-eval counts on it).
    5. the grammar is complete with the token: ``stop``.
    6. the token is the ``max_new_tokens``-th: ``length``.

    Args:
        seq: the sequence, before the token is recorded (``n_generated`` tokens so far); its
            sampler has accepted ``token``.
        token: the token sampled for it this step, or None (rule 1).
        eog: the model's end-of-generation token ids.
        now: ``time.monotonic()`` seconds when the step's decode ended.
    """
    sampling = seq.request.sampling
    if token is None:
        return GOES_ON if seq.generates else Verdict(Finish.LENGTH)
    if seq.request.deadline and now >= seq.request.deadline:
        return Verdict(Finish.DEADLINE, served=False, published=False)
    constraint = seq.sampler.constraint if seq.sampler is not None else None
    if constraint is not None and constraint.error:
        return Verdict(Finish.ERROR, ErrorCode.CONSTRAINT, published=False)
    if token in sampling.stop_ids or (token in eog and not sampling.ignore_eos):
        return Verdict(Finish.STOP, published=seq.scoring)
    if constraint is not None and constraint.complete:
        return Verdict(Finish.STOP)
    if seq.n_generated + 1 >= (sampling.max_new_tokens or 0):
        return Verdict(Finish.LENGTH)
    return GOES_ON
