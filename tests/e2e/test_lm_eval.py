"""lm-evaluation-harness end to end, offline: ``local-completions`` against the shared real server,
with the tokenizer it finds at ``GET /tokenizer_info`` (no Hugging Face download), runs a
multiple-choice task and a generation task kept in ``tests/e2e/lm_eval/`` (``dataset_path: json``
over ``items.jsonl``). Every loglikelihood it reports is checked against one computed here
directly with llama-cpp-python on the weights the engine computes with."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "e2e" / "lm_eval"
#: Per-item tolerance on a loglikelihood (nats). Measured: about 1e-6 (float32 sums of
#: identical logits); the issue allows 1e-3.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def evaluation(server, tmp_path_factory, request):
    """lm_eval.simple_evaluate over both tasks, its samples logged."""
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
    mp.chdir(ROOT)  # the task files name their data relative to the repository
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Our two tasks only: indexing lm-eval's 14,685 built-in ones took 14 s of this fixture.
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{server.url}/v1/completions", "model": "local-model", "num_concurrent": 4,
                    "max_retries": 1, "max_length": 500},
        tasks=["server_mc", "server_gen"], task_manager=tasks,
        batch_size=4, log_samples=True, random_seed=0, numpy_random_seed=0)


@pytest.fixture(scope="module")
def reference():
    """Loglikelihoods from llama-cpp-python's own ``Llama`` over the engine's weight file
    (Q8_0, converted as the engine converts it: engine/llama/weights.py), in prompt chunks of
    at most 63 tokens with flash attention, so on its row-by-row path, where the engine decodes
    these prompts of under 64 tokens too (each row's logits do not depend on what else a decode
    holds: docs/architecture.md, "Prefix cache")."""
    import llama_cpp
    import llama_cpp.llama_cpp as low

    from engine.llama.library import amx_faults
    from engine.llama.weights import weights_path
    from server.config import default_model_path

    path = weights_path(default_model_path(), "auto")
    params = low.llama_model_default_params()
    params.use_extra_bufts = not amx_faults(path)  # where AMX faults, as the engine loads it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(low, "llama_model_default_params", lambda: params)
        llm = llama_cpp.Llama(path, n_ctx=512, n_batch=63, n_ubatch=63, logits_all=True, flash_attn=True,
                              n_threads=1, n_threads_batch=1, verbose=False)

    def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
        """lm-eval's encoding (``TemplateLM._encode_pair``: trailing spaces of the context move
        to the continuation; an empty context is the BOS token), then the sum of the
        continuation's log-probabilities and whether each was the argmax."""
        spaces = len(context) - len(context.rstrip())
        context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
        encode = lambda s: llm.tokenize(s.encode(), add_bos=False, special=True)  # noqa: E731
        whole, ctx = encode(context + continuation), encode(context)
        cont = whole[len(ctx):]
        if not ctx:
            ctx = [llm.token_bos()]
        tokens = ctx + cont
        # The choices of one question share its context: keep the cells (and logits rows) of
        # the tokens the last call shared, as llama-cpp-python's own generate does.
        keep = 0
        while keep < min(llm.n_tokens, len(tokens) - 1) and llm.input_ids[keep] == tokens[keep]:
            keep += 1
        llm.n_tokens = keep
        llm.eval(tokens[keep:])
        logits = np.asarray(llm.scores[:len(tokens)], np.float64)
        rows = logits[len(ctx) - 1:len(tokens) - 1]
        lse = rows.max(1) + np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1))
        return float(sum(rows[i, t] - lse[i] for i, t in enumerate(cont))), \
            all(rows[i].argmax() == t for i, t in enumerate(cont))

    yield loglikelihood
    llm.close()


def test_multiple_choice_loglikelihoods_match_llama_cpp(evaluation, reference):
    samples = evaluation["samples"]["server_mc"]
    assert len(samples) == 32
    correct, worst = 0, 0.0
    for s in samples:
        ours = [r[0] for r in s["resps"]]  # one (loglikelihood, is_greedy) per choice
        theirs = [reference(*args) for args in s["arguments"]]
        worst = max(worst, max(abs(a[0] - b[0]) for a, b in zip(ours, theirs)))
        assert [a[1] for a in ours] == [b[1] for b in theirs]
        correct += int(np.argmax([b[0] for b in theirs]) == s["target"])
    assert worst <= TOLERANCE, worst
    acc = evaluation["results"]["server_mc"]["acc,none"]
    assert acc == correct / len(samples)
    assert acc > 0.5  # well above chance (0.25): the prompt's own tokens are scored


def test_generation_task_runs(evaluation):
    samples = evaluation["samples"]["server_gen"]
    assert len(samples) == 32 and all(isinstance(s["resps"][0][0], str) for s in samples)
    assert evaluation["results"]["server_gen"]["exact_match,strip"] > 0


def test_the_lm_eval_command_prints_its_results_table(evaluation):
    """The ``lm_eval`` command of docs/api.md ends by printing this table (pytablewriter, which
    the test extra installs: without it the command failed after the whole evaluation)."""
    from lm_eval.utils import make_table

    table = make_table(evaluation)
    assert "server_mc" in table and "server_gen" in table and "acc" in table
