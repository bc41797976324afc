"""Tensor parallel across two "nodes" on one machine (issue 43 item 3).

The test makes two network namespaces joined by a veth pair (10.231.0.1 and 10.231.0.2, on the
veth inside the namespaces only, so the traffic never leaves them). Node 0 (namespace A) runs an
engine with `tensor_parallel_size=2, nnodes=2, master_addr=10.231.0.1`, which starts rank 0;
node 1 (namespace B) starts rank 1 by hand, as torchrun would, joining through env://. Each
node reaches the other only over the veth, as two machines would. The greedy tokens must equal
one rank's; then rank 1 is killed on node 1 while a request runs: the request fails at once
(rank 0's collective fails, long before `worker_timeout_s`) and nothing is left behind (no
process of either node, both namespaces deleted). Root and iproute2's `ip` are needed: without
them the test is skipped, saying which is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_tp import _tiny_shape

ROOT = Path(__file__).resolve().parents[1]
NODE0, NODE1 = "10.231.0.1", "10.231.0.2"
PORT = 29500  # fixed, as nnodes > 1 requires; the namespaces are new, so it is free there
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
TIMEOUT_S = 120

# Node 0's engine: prints its greedy tokens, then on "go" runs a long request and stops at its first error.
NODE0_SCRIPT = """
import json, sys, time
from engine.seam import EngineCoreRequest
from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
model, addr, port, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model=model, dtype="float32", tensor_parallel_size=2, nnodes=2, master_addr=addr, master_port=port,
          num_blocks=8, max_num_seqs=2)
sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
outs = llm.generate(prompts, sp, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "local": list(llm.engine_core.executor.procs),
                  "pids": llm.engine_core.executor.pids}), flush=True)
core = llm.engine_core
core.add_request(EngineCoreRequest("long", [1, 2, 3], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                                   None, 0.0, 60))
core.step()
print(json.dumps({"running": True}), flush=True)
sys.stdin.readline()  # rank 1 is killed now
start = time.monotonic()
try:
    for _ in range(200):
        core.step()
    error = ""
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"error": error, "seconds": time.monotonic() - start}), flush=True)
core.shutdown()
"""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _namespaces() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}


@pytest.fixture
def two_nodes():
    """Namespaces (A, B) joined by a veth pair: A holds NODE0, B holds NODE1. Deleted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is missing (scripts/setup.sh --test installs it)")
    a, b = f"sl{os.getpid()}a", f"sl{os.getpid()}b"
    made = [ns for ns in (a, b) if _ip("netns", "add", ns).returncode == 0]
    try:
        if len(made) < 2:
            pytest.skip(f"cannot create network namespaces here: {_ip('netns', 'add', a + 'x').stderr.strip()}")
        steps = [("link", "add", "va", "netns", a, "type", "veth", "peer", "name", "vb", "netns", b),
                 ("-n", a, "addr", "add", f"{NODE0}/24", "dev", "va"), ("-n", b, "addr", "add", f"{NODE1}/24", "dev", "vb"),
                 ("-n", a, "link", "set", "va", "up"), ("-n", b, "link", "set", "vb", "up"),
                 ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up")]
        for step in steps:
            proc = _ip(*step)
            assert proc.returncode == 0, f"ip {' '.join(step)}: {proc.stderr}"
        yield a, b
    finally:
        for ns in made:
            _ip("netns", "delete", ns)  # deletes its end of the veth, and so the pair
        _ip("netns", "delete", a + "x")
        assert not {a, b} & _namespaces(), "a namespace outlived the test"
        assert _ip("link", "show", "va").returncode != 0 and _ip("link", "show", "vb").returncode != 0


def _read_json(proc: subprocess.Popen[str]) -> dict:
    """The next JSON line node 0 prints (its log lines go to stderr)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"node 0 exited ({proc.wait()}) before answering")


def _pids_in(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns).stdout.split()]


@pytest.mark.timeout(TIMEOUT_S * 2)
def test_tp_over_two_namespaces_matches_one_rank_and_a_killed_node1_rank_fails_fast(two_nodes, tmp_path) -> None:
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    a, b = two_nodes
    model = _tiny_shape(tmp_path)
    one = LLM(model=model, dtype="float32", num_blocks=8, max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0,
                                                                                 ignore_eos=True), use_tqdm=False)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    node0 = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-c", NODE0_SCRIPT, model, NODE0, str(PORT),
                              json.dumps(PROMPTS)],
                             cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # node 1: rank 1 with torchrun's variables; `ip netns exec` execs, so this pid is the worker's
    node1 = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-m", "engine.distributed.worker_proc",
                              "--executor", f"tcp://{NODE0}:{PORT + 1}"], cwd=ROOT,
                             env=dict(env, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR=NODE0,
                                      MASTER_PORT=str(PORT)))
    try:
        first = _read_json(node0)
        assert first["local"] == [0]  # node 0 started only its own rank
        assert first["tokens"] == want
        assert set(_pids_in(b)) == {node1.pid}
        assert _read_json(node0) == {"running": True}
        os.kill(node1.pid, signal.SIGKILL)
        assert node0.stdin is not None
        node0.stdin.write("go\n")
        node0.stdin.flush()
        failed = _read_json(node0)
        print(f"node 1's rank killed: the request failed after {failed['seconds']:.2f} s")
        # rank 0's collective failed (not the worker timeout's "no answer"), naming a rank
        assert "ExecutorDiedError" in failed["error"] and "worker rank" in failed["error"], failed
        assert node0.wait(timeout=TIMEOUT_S) == 0
        node1.wait(timeout=10)
        assert _pids_in(a) == [] and _pids_in(b) == []  # no process of either node left
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_interface_towards_names_the_route_owner() -> None:
    """No namespaces needed: the loopback master is reached over `lo` (and gloo keeps its own choice)."""
    from engine.distributed.netif import interface_towards

    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("not-an-address") is None
