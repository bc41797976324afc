#!/usr/bin/env bash
# The test suite in two phases (make test):
#   1. every test not marked `serial`, on TEST_WORKERS pytest-xdist workers (default 2; each test file
#      stays on one worker, so a module's shared engine or server is started once);
#   2. the `serial` tests alone: they time a server and a client on one core each and compare the
#      figures of two clients (the vLLM-keys check against `vllm bench serve`), so they want the machine.
# Phase 1's workers are pinned one per core (tests/conftest.py), so a test timing one process (the A/B and
# gate tests, servelab-explain's cases) has its core to itself there, as the paired gate's power table did.
# Both phases get the arguments given (PYTEST_ARGS in make); a phase that selects no test is not a failure,
# but the two selecting none is. TEST_WORKERS=0 runs phase 1 without workers (one process, as plain pytest).
#
#   PY            the interpreter (default .venv/bin/python)
#   TEST_WORKERS  phase 1's workers (default 2)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}
NO_TESTS=5  # pytest's exit status when a run collects no test

if [ "$WORKERS" = 0 ]; then
  parallel=()
else
  parallel=(-n "$WORKERS" --dist loadfile)
fi
echo "[test] phase 1: the tests not marked serial (${WORKERS} workers)"
"$PY" -m pytest -q "${parallel[@]}" -m "not serial" "$@"
rc1=$?
echo "[test] phase 2: the serial tests, alone"
"$PY" -m pytest -q -m serial "$@"
rc2=$?
if [ "$rc1" = "$NO_TESTS" ] && [ "$rc2" = "$NO_TESTS" ]; then
  echo "[test] no test selected" >&2
  exit "$NO_TESTS"
fi
for rc in "$rc1" "$rc2"; do
  if [ "$rc" != 0 ] && [ "$rc" != "$NO_TESTS" ]; then
    echo "[test] failed (phase 1 exit $rc1, phase 2 exit $rc2)" >&2
    exit "$rc"
  fi
done
