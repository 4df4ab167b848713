"""The step plan as a value and the finish rule, without the model: the KV cell actions a plan
carries for a prefix reused and for a preemption (engine/step_plan.py, engine/scheduler.py,
engine/prefix_cache.py), and what engine/finish.py decides for each way a sequence ends."""
from __future__ import annotations

import numpy as np

from engine.finish import GOES_ON, Verdict, finish_of
from engine.llama.backend import CPU_DETERMINISTIC
from engine.llama.sampler import AllowAll, Sampler
from engine.prefix_cache import COPY_CELLS_PER_REUSED_TOKEN, MIN_REUSE_TOKENS, PrefixCache
from engine.request import EngineRequest, Priority, RequestKind, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_plan import CopyCells, FreeCells
from shm import ErrorCode, Finish

SLOTS = 2
TENANT, OTHER = 7, 8
EOG = frozenset({2})


def tokens(n: int, start: int = 100) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def sequence(prompt: np.ndarray, tenant: int = TENANT, max_new_tokens: int = 4, deadline: float = 0.0,
             kind: RequestKind = RequestKind.GENERATE, **sampling) -> Sequence:
    """A sequence of ``tenant``; ``sampling``: more SamplingParams fields (greedy by default)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **sampling)
    r = EngineRequest(prompt, params, Priority.NORMAL, deadline, tenant, kind=kind)
    return Sequence(mailbox=0, lease=1, request=r, arrival=0.0)


def scheduler(cache: PrefixCache | None, **kw) -> Scheduler:
    return Scheduler(SLOTS, "continuous", aging_s=1e9, n_batch=512, backend=CPU_DETERMINISTIC, cache=cache, **kw)


def test_a_cached_prefix_is_a_copy_in_the_plan_and_counted_as_prefilled():
    cache = PrefixCache(first_stream=SLOTS, n_streams=2, max_tokens=1000)
    cached = tokens(40)
    stream, evicted = cache.insert(TENANT, cached)
    assert (stream, evicted) == (SLOTS, [])
    sched = scheduler(cache)
    seq = sequence(np.concatenate([cached, tokens(5, start=900)]))
    stranger = sequence(np.concatenate([cached, tokens(5, start=900)]), tenant=OTHER)
    sched.add(seq)
    sched.add(stranger)
    plan = sched.schedule(0.0)
    assert plan.admitted == [seq, stranger] and not plan.preempted
    # The copy is decided, not done: the plan carries it; the stranger's tenant holds nothing.
    assert plan.cells == [CopyCells(src=SLOTS, dst=seq.slot, n_tokens=40)]
    assert seq.n_cached == 40 and stranger.n_cached == 0
    assert [(r.seq, r.pos, len(r.tokens)) for r in plan.rows] == [(seq, 40, 5), (stranger, 0, 45)]


def test_a_whole_cached_prompt_leaves_its_last_token_to_decode_and_scoring_reuses_nothing():
    cache = PrefixCache(first_stream=SLOTS, n_streams=1, max_tokens=1000)
    cache.insert(TENANT, tokens(30))
    sched = scheduler(cache)
    same = sequence(tokens(30))
    scoring = sequence(tokens(30), max_new_tokens=0, kind=RequestKind.SCORE)
    sched.add(same)
    sched.add(scoring)
    plan = sched.schedule(0.0)
    assert plan.cells == [CopyCells(SLOTS, same.slot, 29)]  # the last token's logits give the next
    assert scoring.n_cached == 0 and [r.samples for r in plan.rows] == [True, False]


def test_a_prefix_short_against_the_cells_its_source_holds_is_not_copied():
    source = tokens(1000)
    need = len(source) // COPY_CELLS_PER_REUSED_TOKEN
    assert need > MIN_REUSE_TOKENS
    for shared, copied in ((need - 1, False), (need, True)):
        cache = PrefixCache(first_stream=SLOTS, n_streams=1, max_tokens=2000)
        cache.insert(TENANT, source)
        sched = scheduler(cache)
        seq = sequence(np.concatenate([source[:shared], tokens(3, start=50)]))
        sched.add(seq)
        plan = sched.schedule(0.0)
        assert plan.cells == ([CopyCells(SLOTS, seq.slot, shared)] if copied else []), shared


def test_a_sequence_waits_for_a_siblings_prefill_then_copies_it_from_the_siblings_slot():
    cache = PrefixCache(first_stream=SLOTS, n_streams=1, max_tokens=1000)
    sched = scheduler(cache)
    system = tokens(140)
    first = sequence(np.concatenate([system, tokens(10, start=900)]))
    sched.add(first)
    assert sched.schedule(0.0).admitted == [first] and first.n_past == 63  # a chunk of 63
    second = sequence(np.concatenate([system, tokens(10, start=950)]))
    sched.add(second)
    for n_past in (126, 150):  # held while the sibling still prefills 8 or more of the shared tokens
        plan = sched.schedule(0.0)
        assert plan.admitted == [] and second.status == SequenceStatus.WAITING and first.n_past == n_past
    plan = sched.schedule(0.0)
    assert plan.admitted == [second]
    assert plan.cells == [CopyCells(src=first.slot, dst=second.slot, n_tokens=140)]
    assert [(r.seq, r.pos, len(r.tokens)) for r in plan.rows] == [(first, 149, 1), (second, 140, 10)]


def test_a_preemption_keeps_the_cells_in_the_cache_then_frees_the_slot_in_the_plan():
    cache = PrefixCache(first_stream=SLOTS, n_streams=2, max_tokens=60)
    cache.insert(OTHER, tokens(5, start=5000))  # least recently used
    cache.insert(OTHER, tokens(52, start=6000))
    sched = scheduler(cache, kv_tokens=21)
    old, young = sequence(tokens(10, start=300)), sequence(tokens(10, start=400))
    sched.add(old)
    sched.add(young)
    plan = sched.schedule(0.0)
    assert plan.admitted == [old, young] and all(s.status == SequenceStatus.DECODE for s in (old, young))
    old.generated(11)
    young.generated(12)
    slot = young.slot
    plan = sched.schedule(0.0)  # two decodes would hold 22 cells, one over the budget
    assert plan.preempted == [young] and plan.admitted == [] and young.status == SequenceStatus.WAITING
    # Keeping 10 cells within 60 evicts both entries; the stream freed first is the one the copy
    # does not overwrite. Then the slot is freed.
    assert plan.cells == [FreeCells(SLOTS + 1), CopyCells(src=slot, dst=SLOTS), FreeCells(slot)]
    assert list(cache.entries) == [SLOTS] and cache.entries[SLOTS].tokens.tolist() == tokens(10, start=400).tolist()
    assert [(r.seq, r.pos) for r in plan.rows] == [(old, 10)] and young.slot == -1 and young.n_past == 0


def test_without_a_cache_a_preemption_only_frees_and_nothing_is_held_for_a_prefix():
    sched = scheduler(None, kv_tokens=21)
    old, young = sequence(tokens(10)), sequence(tokens(10))
    sched.add(old)
    sched.add(young)
    assert sched.schedule(0.0).cells == []
    old.generated(11)
    young.generated(12)
    plan = sched.schedule(0.0)
    assert plan.preempted == [young] and plan.cells == [FreeCells(1)]


class Ended(AllowAll):
    """A constraint whose grammar has ended: complete, or failed."""

    def __init__(self, complete: bool = False, error: str = ""):
        self.complete, self.error = complete, error


def started(max_new_tokens: int = 4, constraint=None, generated: int = 0, **request) -> Sequence:
    """A sequence admitted and sampling (a real greedy Sampler, with ``constraint``), ``generated``
    tokens so far; ``request``: more :func:`sequence` arguments."""
    seq = sequence(tokens(5), max_new_tokens=max_new_tokens, **request)
    seq.start_history()
    seq.sampler = Sampler(49152, seq.request.sampling, frozenset(), seq.prompt, constraint)
    for i in range(generated):
        seq.generated(500 + i)
    return seq


def test_the_finish_rule():
    assert finish_of(started(), 42, EOG, 1.0) == GOES_ON == Verdict(Finish.NONE, ErrorCode.NONE, True, True)
    # end-of-generation and stop ids end a sequence, the token unpublished
    assert finish_of(started(), 2, EOG, 1.0) == Verdict(Finish.STOP, published=False)
    assert finish_of(started(stop_ids=(42,)), 42, EOG, 1.0) == Verdict(Finish.STOP, published=False)
    assert finish_of(started(ignore_eos=True), 2, EOG, 1.0) == GOES_ON
    # a scoring request reports the token that ended it
    scoring = started(kind=RequestKind.SCORE)
    assert finish_of(scoring, 2, EOG, 1.0) == Verdict(Finish.STOP)
    # length: the max_new_tokens-th token is published and ends the sequence
    assert finish_of(started(max_new_tokens=4, generated=2), 42, EOG, 1.0) == GOES_ON
    assert finish_of(started(max_new_tokens=4, generated=3), 42, EOG, 1.0) == Verdict(Finish.LENGTH)
    # a grammar: complete ends with stop after the token; failed is an error, the token unpublished
    assert finish_of(started(constraint=Ended(complete=True)), 42, EOG, 1.0) == Verdict(Finish.STOP)
    assert finish_of(started(constraint=Ended(error="no")), 42, EOG, 1.0) == \
        Verdict(Finish.ERROR, ErrorCode.CONSTRAINT, published=False)
    assert finish_of(started(constraint=AllowAll()), 42, EOG, 1.0) == GOES_ON
    # a deadline that passed while the step computed: nothing served, nothing published, first
    late = started(deadline=1.0, constraint=Ended(error="no"))
    assert finish_of(late, 2, EOG, 1.0) == Verdict(Finish.DEADLINE, served=False, published=False)
    assert finish_of(late, 42, EOG, 0.5) == Verdict(Finish.ERROR, ErrorCode.CONSTRAINT, published=False)
    # no token sampled: a prompt scored whole ends when nothing is left to generate
    assert finish_of(started(max_new_tokens=0, kind=RequestKind.SCORE), None, EOG, 9.0) == Verdict(Finish.LENGTH)
    assert finish_of(started(max_new_tokens=2, kind=RequestKind.SCORE, deadline=1.0), None, EOG, 9.0) == GOES_ON
