# The two commands a new user types:
#   make bench   run the default experiment on the embedded default model; prints the HTML report path
#   make test    lint, type-check, run the test suite, then the performance gate
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.servelab-setup
TEST_STAMP := $(VENV)/.servelab-test-setup
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

GATE_RUN := runs/ci_gate/latest
GATE_PAIRED := runs/ci_gate/paired
GATE_BASELINE := benchmarks/baselines/ci_gate.json

.PHONY: setup bench test lint typecheck docs gate gate-stored gate-baseline soak gpu-check peers peers-llamacpp peers-llamacpp-python ray-venv clean

$(SETUP_STAMP): pyproject.toml constraints.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

$(TEST_STAMP): pyproject.toml constraints.txt scripts/setup.sh
	bash scripts/setup.sh --test
	touch $@ $(SETUP_STAMP)

setup: $(SETUP_STAMP)

# `make bench model=gemma3-270m` (any conf/model/*.yaml name) runs the same experiment on another model;
# BENCH_ARGS passes further Hydra overrides (`make bench BENCH_ARGS='workload.num_requests=32'`).
BENCH_ARGS ?=
bench: $(SETUP_STAMP)
	$(VENV)/bin/servelab-run $(if $(model),model=$(model)) $(BENCH_ARGS)

lint: $(TEST_STAMP)
	$(PY) -m ruff check engine workloads profiling reports tests benchmarks history analysis

# mypy's cache lives outside the checkout, so a fresh clone re-checks only what differs from the last run
# (mypy takes a cached module whose path or mtime changed when its content hash is the same): ~30 s -> ~2 s.
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/servelab/mypy

typecheck: $(TEST_STAMP)
	MYPY_CACHE_DIR=$(MYPY_CACHE) $(PY) -m mypy

# The field tables of docs/configuration.md, from the config dataclasses' field docstrings
# (engine/config.py, conf/schema.py); tests/test_config_docs.py fails while they differ.
docs: $(SETUP_STAMP)
	$(PY) scripts/gen_config_docs.py

# The suite in two phases (scripts/run_tests.sh): the tests not marked serial on TEST_WORKERS workers
# (default 2), then the serial (timing-sensitive) ones alone. PYTEST_ARGS go to both phases.
test: $(TEST_STAMP) lint typecheck
	PY=$(PY) TEST_WORKERS=$(TEST_WORKERS) bash scripts/run_tests.sh $(PYTEST_ARGS)
	$(MAKE) --no-print-directory gate

# The performance gate (docs/benchmarks.md): this checkout against the previous commit (on a
# branch: the merge-base with main), both measured pair by pair in the same run, about 3 minutes
# (conf/gate/paired.yaml); prints metric, baseline, candidate, change, interval, verdict. Without
# git history (no .git, a shallow clone, a first commit) it says so and runs gate-stored instead.
gate: $(TEST_STAMP)
	rm -rf $(GATE_RUN) $(GATE_PAIRED)
	$(VENV)/bin/servelab-gate --against auto --out $(GATE_PAIRED) --fallback-baseline $(GATE_BASELINE) --fallback-run $(GATE_RUN)

# The stored-baseline gate: the ci_gate experiment against the committed baseline
# (machine-independent metrics exactly, time as a ratio to a reference timed in the same run).
gate-stored: $(TEST_STAMP)
	rm -rf $(GATE_RUN)
	$(VENV)/bin/servelab-run experiment=ci_gate hydra.run.dir=$(GATE_RUN)
	$(VENV)/bin/servelab-gate --config conf/gate/ci.yaml --baseline $(GATE_BASELINE) $(GATE_RUN)

# The long checks of reliability (docs/reliability.md): the scheduler/KV-cache state machine with
# thousands of examples, the API fuzzed with 1,000 cases per route, 10 minutes at 3x capacity.
soak: $(TEST_STAMP)
	HYPOTHESIS_PROFILE=soak $(PY) -m pytest -q -s tests/test_scheduler_properties.py
	FUZZ_CASES=1000 $(PY) -m pytest -q -s tests/test_server_fuzz.py
	$(PY) benchmarks/soak.py --duration-s 600 --overload 3 --json runs/soak.json

# Re-make the baseline (on a quiet machine) after an intended change of behaviour.
gate-baseline: $(TEST_STAMP)
	rm -rf runs/ci_gate/base-1 runs/ci_gate/base-2 runs/ci_gate/base-3
	for i in 1 2 3; do $(VENV)/bin/servelab-run experiment=ci_gate hydra.run.dir=runs/ci_gate/base-$$i || exit 1; done
	mkdir -p $(dir $(GATE_BASELINE))
	$(VENV)/bin/servelab-gate --make-baseline $(GATE_BASELINE) runs/ci_gate/base-1 runs/ci_gate/base-2 runs/ci_gate/base-3

# GPU readiness (scripts/gpu_check.sh, docs/benchmarks.md): the full time-boxed check where nvidia-smi
# finds a GPU (it sets up its own environment); elsewhere its dry run, under the test venv.
gpu-check:
	@if nvidia-smi -L >/dev/null 2>&1; then bash scripts/gpu_check.sh; \
	else $(MAKE) --no-print-directory $(TEST_STAMP) && bash scripts/gpu_check.sh --dry-run --python $(PY); fi

# vLLM's CPU build in a side venv (~/.cache/servelab-peers/vllm) and the model as an HF folder, for
# benchmarks/offline_throughput.py --peer vllm and benchmarks/serving_throughput.py --peer vllm.
peers: $(SETUP_STAMP)
	PY=$(PY) bash scripts/peers.sh

# llama.cpp's own llama-server and llama-bench, built natively (~/.cache/servelab-peers/llamacpp-bin, ~25 min on
# 2 cores), for serving_throughput.py --peer llamacpp and c1_inprocess.py's llama-bench row.
peers-llamacpp:
	PY=$(PY) bash scripts/peers.sh --llamacpp

# llama-cpp-python's server (one request at a time) in a side venv (~/.cache/servelab-peers/llamacpp), for
# target=llamacpp, serving_throughput.py --peer llamacpp-python and c1_inprocess.py's in-process row.
peers-llamacpp-python:
	bash scripts/peers.sh --llamacpp-python

# Ray and hydra-ray-launcher in a side venv over .venv (~/.cache/servelab-ray; RAY_VENV to move it): Ray needs
# cloudpickle < 3, kept out of .venv. For hydra/launcher=ray; tests/test_launcher_ray.py skips, saying so, without it.
ray-venv: $(TEST_STAMP)
	VENV=$(VENV) bash scripts/ray_venv.sh

clean:
	rm -rf runs outputs multirun test-output .pytest_cache .mypy_cache .ruff_cache
