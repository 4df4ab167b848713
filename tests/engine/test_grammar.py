"""Grammar constraints in the engine (engine/llama/grammar.py, the sampler's constraint slot):
every token of a constrained sequence is allowed by its own constraint, a complete grammar stops
the sequence, a failed one ends it with an error, and unconstrained sequences in the same batch
generate what they generate alone. A real model in an in-process engine (engine/inproc.py)."""
from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from engine.config import EngineConfig
from engine.errors import ConstraintFailed, InvalidRequest
from server.structured.check import check
from engine.request import SamplingParams
from tests.support.servers import inproc_engine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})


@pytest.fixture(scope="module")
def engine(model_path):
    with inproc_engine(EngineConfig(model_path=model_path, max_slots=4, max_seq_len=256, max_queued=8)) as e:
        yield e


def _run(engine, tokenizer, prompt: str, **params):
    stream = engine.client.submit(tokenizer.encode(prompt, add_bos=True), SamplingParams(**params))
    ids = [t.id for t in stream]
    return tokenizer.decode(ids), stream.finish_reason


def test_constrained_and_unconstrained_sequences_share_a_batch(engine, tokenizer):
    prompt = tokenizer.encode("A person as JSON:", add_bos=True)
    free = SamplingParams(max_new_tokens=24, temperature=0)
    alone = [t.id for t in engine.client.submit(prompt, free)]
    streams = [engine.client.submit(prompt, SamplingParams(max_new_tokens=48, temperature=t, seed=j, grammar=GRAMMAR))
               for j, t in enumerate((0.0, 1.0, 1.0))] + [engine.client.submit(prompt, free)]
    outputs = [([t.id for t in s], s.finish_reason) for s in streams]
    for ids, reason in outputs[:3]:
        assert reason in ("stop", "length")
        if reason == "stop":  # a complete grammar stopped it: the text is a valid document
            jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)
    assert any(reason == "stop" for _, reason in outputs[:3])
    assert outputs[3] == (alone, "length")  # the unconstrained neighbour is unchanged


def test_length_before_the_grammar_is_complete(engine, tokenizer):
    text, reason = _run(engine, tokenizer, "JSON:", max_new_tokens=3, temperature=0, grammar=GRAMMAR)
    assert reason == "length" and text.startswith("{")


def test_regex_and_choice_grammars(engine, tokenizer):
    text, reason = _run(engine, tokenizer, "A date:", max_new_tokens=16, temperature=1.0, seed=3,
                        grammar=llguidance.LLMatcher.grammar_from_regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))
    assert reason == "stop" and len(text) == 10 and text.startswith("20")
    text, reason = _run(engine, tokenizer, "Is the sky blue?", max_new_tokens=8, temperature=1.0, seed=1,
                        grammar=llguidance.grammar_from("choice", ["yes", "no"]))
    assert (text, reason) in (("yes", "stop"), ("no", "stop"))


def test_a_grammar_that_fails_ends_the_sequence_with_an_error(engine, tokenizer):
    # Only the end of generation may come, and ignore_eos bans it: nothing the grammar allows is
    # left to sample. The sequence must end with an error, never go on unconstrained.
    with pytest.raises(ConstraintFailed):
        _run(engine, tokenizer, "x", max_new_tokens=8, ignore_eos=True,
             grammar=llguidance.LLMatcher.grammar_from_regex(""))
    assert engine.client.mailboxes_in_use() == 0


@pytest.mark.parametrize("grammar", [llguidance.LLMatcher.grammar_from_regex(r"[^\s\S]"),
                                     llguidance.LLMatcher.grammar_from_json_schema({"$ref": "#"})])
def test_a_grammar_with_no_first_step_ends_the_sequence_with_an_error(engine, tokenizer, grammar):
    # No text is an instance: llguidance's first mask is in error and holds only the end, which
    # once passed for an empty "stop". The front end refuses these (check(..., text_only=True));
    # the engine must not serve one that reaches it.
    assert check(grammar) == "" and check(grammar, text_only=True)
    with pytest.raises(ConstraintFailed):
        _run(engine, tokenizer, "x", max_new_tokens=8, grammar=grammar)
    assert engine.client.mailboxes_in_use() == 0


def test_an_uncompilable_grammar_in_a_record_is_refused_by_the_engine(engine, tokenizer):
    bad = llguidance.LLMatcher.grammar_from_regex("[a-")
    assert "unclosed character class" in check(bad)  # what the front end refuses with a 400
    with pytest.raises(InvalidRequest):
        _run(engine, tokenizer, "x", max_new_tokens=4, grammar=bad)
    assert engine.client.mailboxes_in_use() == 0


def test_compiled_grammars_are_cached_per_tenant_and_bounded(tokenizer):
    import llama_cpp

    from engine.llama.grammar import Grammars
    from server.structured.check import CheckedGrammars

    eog = frozenset(t for t in range(tokenizer.n_vocab) if llama_cpp.llama_vocab_is_eog(tokenizer.vocab, t))
    grammars = Grammars(tokenizer.vocab, eog, tokenizer.n_vocab, capacity=2)
    try:
        first = grammars.compile(1, GRAMMAR)
        assert grammars.compile(1, GRAMMAR) is first  # cached: no second compile
        other = grammars.compile(2, GRAMMAR)
        assert other is not first  # another tenant's own entry
        grammars.compile(3, GRAMMAR).result()
        assert grammars.compile(1, GRAMMAR) is not first  # the least recently used was evicted
        a, b = grammars.constraint(first), grammars.constraint(first)
        a.accept(tokenizer.encode("{")[0])
        assert not a.error and b.allows(tokenizer.encode("{")[0])  # each sequence its own state
    finally:
        grammars.close()
    checked = CheckedGrammars(capacity=1)
    assert checked.check(1, GRAMMAR) == "" and checked.check(2, "not a grammar") != ""


def test_an_engine_stopped_as_it_starts_exits_cleanly(model_path):
    """The grammar thread builds llguidance's tokenizer from the model's vocabulary for half a
    second after the start; an engine stopped then waits for it before freeing the model (it
    died of SIGSEGV, leaving its shared memory). In a child process, so a crash fails this test
    only."""
    import subprocess
    import sys

    script = ("import sys; from engine.config import EngineConfig; from engine.inproc import InprocEngine\n"
              "with InprocEngine(EngineConfig(model_path=sys.argv[1], max_slots=1, max_seq_len=64, n_threads=1)) "
              "as engine:\n    name = engine.transport.name\n"
              "import os; assert not os.path.exists('/dev/shm/' + name)\n")
    run = subprocess.run([sys.executable, "-c", script, model_path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
