# The two commands: `make serve` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch 2.13.0: a CPU build on the dev/CI machines; from PyPI on a GPU host it is the CUDA build.
TORCH_SPEC ?= torch==2.13.0
# the slowest tests at the end of the log: what to look at when the suite nears its 20 minutes
PYTEST_ARGS ?= --durations=20

.PHONY: setup serve test lint demo-assets clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tools/constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c tools/constraints.txt -e ".[test]"
	$(PIP) install -q --no-deps dflash==0.1.0
	touch $@

# A local Ray cluster serving the tiny demo pair (target + trained DFlash draft) over the
# OpenAI API on CPU, tp 2 (gloo); prints a ready-to-paste curl; Ctrl-C stops it cleanly.
# MODEL/DRAFT/TP/DEVICE/PORT override it (e.g. a real checkpoint on a GPU host); SERVE_ARGS
# adds any `dflash-serve serve` flags (e.g. SERVE_ARGS="--max-num-seqs 8"). The API's model
# id: SERVED_NAME, by default tiny-dflash for the demo pair (as deploy/dflash-demo.yaml) and
# for another MODEL its own default (the Hub id, or the directory's name).
MODEL ?= tests/assets/tiny/target
DRAFT ?= tests/assets/tiny/draft
TP ?= 2
DEVICE ?= cpu
PORT ?= 8000
SERVED_NAME ?= $(if $(filter tests/assets/tiny/target,$(MODEL)),tiny-dflash)
# The demo's context past its config's 1,024 positions: Qwen3.5's tool-calling system prompt
# alone is ~1,000 of the demo tokenizer's (byte-sized) tokens.
DEMO_CONTEXT ?= $(if $(filter tests/assets/tiny/target,$(MODEL)),--max-model-len 4096 --allow-long-max-model-len)
serve: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} RAY_USAGE_STATS_ENABLED=0 $(PY) -m deploy.cli serve \
		--model $(MODEL) --draft-model $(DRAFT) --tp $(TP) --device $(DEVICE) --port $(PORT) \
		$(if $(SERVED_NAME),--served-model-name $(SERVED_NAME)) $(DEMO_CONTEXT) $(SERVE_ARGS)

test: setup
	$(PY) -m ruff check .
	# Tiny models: one thread per process is several times faster than two on a 2-core box.
	OMP_NUM_THREADS=1 RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
