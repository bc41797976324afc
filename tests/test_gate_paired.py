"""The paired CI gate (`servelab-gate --against`): its statistics, its git trees, its injector, its CLI,
and one short end-to-end gate on the real engine (two workers, two pairs)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from workloads import gate_cli
from workloads.gate_cli import gate_main
from workloads.gate_stats import MetricRule, format_table, judge, judge_all, paired_change
from workloads.gate_trees import (
    NoHistory,
    dependencies,
    extension_dir_for,
    kernel_digest,
    materialise,
    python_for,
    resolve_baseline,
)
from workloads.paired_gate import GateSettings, parse_perf_instructions, run_paired_gate, worker_env

ROOT = Path(__file__).resolve().parents[1]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="no git executable")
TIME = MetricRule("lower", 0.05)


def _noisy_pairs(ratio: float, sigma: float, n: int, seed: int = 1) -> tuple[list[float], list[float]]:
    """Baseline reps with a load that drifts 2x between pairs; candidate = ratio x baseline x noise."""
    rng = np.random.default_rng(seed)
    load = rng.uniform(1.0, 2.0, n)
    base = 10.0 * load * rng.normal(1.0, sigma, n)
    cand = 10.0 * ratio * load * rng.normal(1.0, sigma, n)
    return base.tolist(), cand.tolist()


# ---- statistics -------------------------------------------------------------------------
def test_paired_ratio_cancels_load_that_both_sides_share():
    base, cand = _noisy_pairs(1.10, 0.01, 16)
    est, _ = paired_change(base, cand)
    change = est.point
    assert change == pytest.approx(0.10, abs=0.01)
    assert 0.0 < est.low <= change <= est.high
    # Unpaired, the 2x load drift swamps the 10%: the medians alone say little.
    assert abs(np.median(cand) / np.median(base) - 1.10) > abs(change - 0.10)


def test_regression_needs_both_the_tolerance_and_an_interval_clear_of_zero():
    assert judge("t", TIME, *_noisy_pairs(1.10, 0.01, 16)).verdict == "REGRESSION"
    assert judge("t", TIME, *_noisy_pairs(1.03, 0.01, 16)).verdict == "ok"  # within tolerance
    # Beyond tolerance on a few wild pairs, but the interval spans 0: noise, not a regression.
    wild = judge("t", TIME, [10.0, 10.0, 10.0], [13.0, 7.0, 10.8])
    assert wild.change > TIME.tolerance and wild.interval is not None and wild.interval[0] < 0
    assert wild.verdict == "ok"
    assert judge("t", TIME, *_noisy_pairs(0.80, 0.01, 16)).verdict == "faster"
    assert judge("t", MetricRule("lower", 0.05, gate=False), *_noisy_pairs(1.2, 0.01, 8)).verdict == "(slower)"


def test_exact_metrics_compare_medians_without_an_interval():
    rule = MetricRule("lower", 0.0, kind="exact")
    same = judge("num_steps", rule, [44.0] * 4, [44.0] * 4)
    assert (same.verdict, same.interval) == ("ok", None)
    assert judge("num_steps", rule, [44.0] * 4, [45.0] * 4).verdict == "REGRESSION"
    assert judge("hits", MetricRule("higher", 0.0, kind="exact"), [0.3] * 2, [0.2] * 2).regressed


def test_judge_all_skips_metrics_a_rep_lacks_and_the_table_has_every_column():
    rules = {"cpu_ms_per_token": TIME, "instructions_per_token": TIME}
    base = [{"cpu_ms_per_token": 6.0}, {"cpu_ms_per_token": 6.2}]
    cand = [{"cpu_ms_per_token": 6.1}, {"cpu_ms_per_token": 6.3}]
    checks = judge_all(rules, base, cand)
    assert [c.metric for c in checks] == ["cpu_ms_per_token"]
    header, row = format_table(checks).splitlines()
    assert header.split() == ["metric", "baseline", "candidate", "change", "95%", "interval", "p", "(generations)",
                              "verdict"]  # fmt: skip
    assert row.split()[0] == "cpu_ms_per_token" and row.split()[-1] == "ok" and row.split()[-2] == "(2)"


def test_bad_metric_rule_is_one_line():
    with pytest.raises(ValueError, match="gate metric x: direction lower|higher"):
        MetricRule.from_dict("x", {"direction": "down"})


def test_perf_output_parsing():
    assert parse_perf_instructions("1234567,,instructions:u,1000,100.00,,\n") == 1234567.0
    assert parse_perf_instructions("<not supported>,,instructions:u,0,100.00,,\n") is None
    assert parse_perf_instructions("") is None


# ---- the test-only injector: a step hook of the gate worker, not engine code ---------------
def _tiny_llm(tmp_path: Path):
    import yaml

    from engine.frontend.llm import LLM

    shape = tmp_path / "tiny.yaml"
    shape.write_text(yaml.safe_dump({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128,
                                     "max_position_embeddings": 64}))  # fmt: skip
    return LLM(model=str(shape), dtype="float32", num_blocks=16, max_num_seqs=4)


def _generate(llm, n: int = 3, tokens: int = 4) -> None:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4 + i] for i in range(n)], params, use_tqdm=False)


def test_the_engine_reads_no_slowdown_variable(monkeypatch, tmp_path):
    """The forward path has no test branch: the variable the old engine read (and refused when it
    was not a fraction) means nothing to a plain engine, and no engine file names it."""
    monkeypatch.setenv("SERVELAB_TEST_SLOWDOWN", "ten percent")
    llm = _tiny_llm(tmp_path)  # the old ModelRunner raised "SERVELAB_TEST_SLOWDOWN: expected a fraction"
    try:
        _generate(llm, n=1, tokens=2)
    finally:
        llm.engine_core.shutdown()
    named = [p for p in (ROOT / "engine").rglob("*.py") if "SERVELAB_TEST_SLOWDOWN" in p.read_text()]
    assert named == [] and not (ROOT / "engine/worker/test_slowdown.py").exists()


def test_gate_worker_hook_spins_after_every_forward(tmp_path):
    from workloads.gate_worker import SlowForward, install_slowdown, spin_cpu

    llm = _tiny_llm(tmp_path)
    try:
        hooks = install_slowdown(llm, 1.0)
        assert isinstance(hooks, SlowForward)
        llm.step_stats.clear()
        _generate(llm)
        steps = list(llm.step_stats)
    finally:
        llm.engine_core.shutdown()
    forwards = [s for s in steps if s.forward_time > 0]
    assert hooks.forwards == len(forwards) > 0  # one spin per forward, counted by the hook
    assert hooks.spun_s >= 1.0 * hooks.forward_cpu_s > 0  # the fraction, on the thread's CPU clock
    assert sum(s.forward_time for s in steps) >= hooks.spun_s  # inside the forward the engine times
    c0 = time.thread_time()
    spin_cpu(0.01)
    assert time.thread_time() - c0 >= 0.01  # CPU time, not a sleep: CPU clocks see the delay
    with pytest.raises(ValueError, match="--test-slowdown: expected a fraction"):
        SlowForward(-0.1)


def test_worker_environment_drops_the_injector_unless_given(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVELAB_TEST_SLOWDOWN", "0.2")
    env = worker_env(tmp_path, 1, None, {})
    assert "SERVELAB_TEST_SLOWDOWN" not in env and env["PYTHONPATH"] == str(tmp_path)
    assert env["OMP_NUM_THREADS"] == "1" and "TORCH_EXTENSIONS_DIR" not in env
    env = worker_env(tmp_path, 1, tmp_path / "ext", {"SERVELAB_TEST_SLOWDOWN": "0.1"})
    assert env["SERVELAB_TEST_SLOWDOWN"] == "0.1" and env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "ext")


# ---- git trees ----------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    return repo


def _commit(repo: Path, name: str, text: str) -> str:
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", name)
    return _git(repo, "rev-parse", "HEAD")


@needs_git
def test_baseline_is_the_parent_on_main_and_the_merge_base_on_a_branch(tmp_path):
    repo = _repo(tmp_path)
    first = _commit(repo, "a.txt", "1")
    with pytest.raises(NoHistory, match="first commit"):
        resolve_baseline(repo)
    second = _commit(repo, "a.txt", "2")
    assert resolve_baseline(repo) == first  # on main: HEAD~1
    _git(repo, "checkout", "-q", "-b", "feature")
    _commit(repo, "b.txt", "x")
    _commit(repo, "b.txt", "y")
    assert resolve_baseline(repo) == second  # ahead of main: the merge-base
    assert resolve_baseline(repo, "HEAD~1") != second
    with pytest.raises(NoHistory, match="git ref 'nope' not found"):
        resolve_baseline(repo, "nope")


@needs_git
def test_no_git_and_shallow_clone_have_no_history(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(NoHistory, match="not a git checkout"):
        resolve_baseline(tmp_path / "plain")
    repo = _repo(tmp_path)
    _commit(repo, "a.txt", "1")
    _commit(repo, "a.txt", "2")
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    with pytest.raises(NoHistory, match="shallow clone"):
        resolve_baseline(shallow)


@needs_git
def test_baseline_tree_is_checked_out_once_per_commit(tmp_path):
    repo = _repo(tmp_path)
    first = _commit(repo, "engine/cpu_extension.py", "kernel v1")
    _commit(repo, "engine/cpu_extension.py", "kernel v2")
    tree = materialise(repo, first)
    assert tree.parent == tmp_path / "repo-gate-trees"
    assert (tree / "engine/cpu_extension.py").read_text() == "kernel v1"
    (tree / "marker").write_text("kept")
    assert materialise(repo, first) == tree and (tree / "marker").exists()  # reused, not re-created
    cache = tmp_path / "cache"
    ext = extension_dir_for(tree, repo, cache)
    assert ext is not None and ext.parent == cache  # kernel sources differ: a build of its own
    assert extension_dir_for(repo, repo, cache) is None
    # since engine/csrc/: a changed or new file there is a change of the kernels too
    third = _commit(repo, "engine/csrc/gemv.cpp", "gemv v1")
    csrc_tree = materialise(repo, third)
    _commit(repo, "engine/csrc/kernel_header.h", "header v1")
    assert kernel_digest(csrc_tree) != kernel_digest(repo)
    # both trees name their builds by digest: one shared cache (a changed kernel builds anew there)
    assert extension_dir_for(csrc_tree, repo, cache) is None
    # a baseline from before engine/csrc/ against a checkout with it: a folder of its own
    assert extension_dir_for(tree, repo, cache) == ext == cache / f"torch_extensions-{kernel_digest(tree)}"
    # the kernels' room (engine/kernels/csrc/, issue 56) against a baseline with engine/csrc/: both by digest
    (repo / "engine/kernels").mkdir()
    _git(repo, "mv", "engine/csrc", "engine/kernels/csrc")
    _git(repo, "commit", "-q", "-m", "the kernels' room")
    assert extension_dir_for(csrc_tree, repo, cache) is None
    assert kernel_digest(repo) != kernel_digest(csrc_tree)  # the paths are part of the digest
    assert extension_dir_for(tree, repo, cache) == ext


@needs_git
def test_gates_started_together_share_one_tree(tmp_path):
    """Two gates on one checkout (gate_power.py's one per core) materialise the same baseline at the
    same moment: both get the tree, none fails in `git worktree add`."""
    repo = _repo(tmp_path)
    first = _commit(repo, "a.txt", "1")
    _commit(repo, "a.txt", "2")
    gun = tmp_path / "go"  # every process imports first, then all start at once
    code = ("import sys, time; from pathlib import Path; from workloads.gate_trees import materialise\n"
            f"Path(sys.argv[1]).touch()\nwhile not Path({str(gun)!r}).exists(): time.sleep(0.001)\n"
            f"print(materialise(Path({str(repo)!r}), {first!r}))")  # fmt: skip
    ready = [tmp_path / f"ready{i}" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1]) for r in ready]  # fmt: skip
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    gun.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "repo-gate-trees" / first[:12])}
    assert (tmp_path / "repo-gate-trees" / first[:12] / "a.txt").read_text() == "1"


def test_dependencies_compare_the_declared_sets(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('[project]\ndependencies = ["torch>=2.4", "numpy"]\n[project.optional-dependencies]\ntest = ["pytest"]\n')
    b.write_text('[project]\ndependencies = ["numpy", "torch>=2.4"]\n[project.optional-dependencies]\ntest = ["pytest"]\n')
    assert dependencies(a) == dependencies(b)
    b.write_text('[project]\ndependencies = ["numpy", "torch>=2.4"]\n[project.optional-dependencies]\ntest = ["pytest", "pytest-xdist"]\n')
    assert dependencies(a) == dependencies(b)  # a test tool more: the gate's workers never import it
    b.write_text('[project]\ndependencies = ["numpy", "torch>=2.5"]\n')
    assert dependencies(a) != dependencies(b)


def test_a_baseline_with_other_dependencies_gets_a_venv_from_its_own_setup(tmp_path):
    """The venv is made by the baseline tree's scripts/setup.sh (its pins, its torch, the model
    package: a bare `pip install` left the model out and the baseline worker failed), once; a venv
    whose set-up stopped half-way is made again."""
    repo, tree, cache = tmp_path / "repo", tmp_path / "tree", tmp_path / "cache"
    for folder, torch_range in ((repo, ">=2.4"), (tree, ">=2.5")):
        (folder / "scripts").mkdir(parents=True)
        (folder / "pyproject.toml").write_text(f'[project]\ndependencies = ["torch{torch_range}"]\n')
    calls = tmp_path / "calls.log"
    (tree / "scripts" / "setup.sh").write_text(
        f'mkdir -p "$VENV/bin" && touch "$VENV/bin/python" && echo "$VENV" >> {calls}\n')
    python, why = python_for(tree, repo, cache)
    assert why.startswith("dependencies differ") and Path(python).is_file()
    assert python_for(tree, repo, cache)[0] == python and len(calls.read_text().splitlines()) == 1  # made once
    (Path(python).parents[1] / ".servelab-gate-ready").unlink()  # as if set-up had stopped half-way
    python_for(tree, repo, cache)
    assert len(calls.read_text().splitlines()) == 2
    (repo / "pyproject.toml").write_text((tree / "pyproject.toml").read_text())
    assert python_for(tree, repo, cache)[0] == sys.executable  # the same dependencies: no venv


# ---- command line ---------------------------------------------------------------------------
def test_cli_bad_input_is_one_line(capsys):
    assert gate_main(["--against", "HEAD", "some/run"]) == 2
    assert capsys.readouterr().err.strip() == "servelab-gate: error: --against measures its own runs: give no run folders"
    assert gate_main(["--against", "HEAD", "--candidate-env", "NOEQUALS"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gate_main(["--baseline", "x.json"])  # the stored mode still needs its run folders


def test_no_history_falls_back_to_the_stored_baseline(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(gate_cli, "run_ci_gate_experiment", lambda run: calls.append(run) or 0)
    args = argparse.Namespace(runs=[], config=None, pairs=None, time_box_s=None, repo=str(tmp_path), against="auto",
                              candidate_env=[], out=None, fallback_baseline="base.json",
                              fallback_run=str(tmp_path / "run"), verbose=False)  # fmt: skip
    seen = []
    assert gate_cli.paired_gate(args, stored_gate=lambda a: seen.append(a) or 0) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"servelab-gate: {tmp_path} is not a git checkout with a commit; falling back to the stored "
                   "baseline base.json"]  # fmt: skip
    assert calls == [tmp_path / "run"]
    assert seen[0].baseline == "base.json" and seen[0].runs == [str(tmp_path / "run")]
    assert seen[0].config.endswith("conf/gate/ci.yaml")


# ---- end to end -----------------------------------------------------------------------------
@needs_git
def test_paired_gate_end_to_end_on_the_real_engine(tmp_path):
    """Two workers (a baseline worktree and a clone of this checkout's HEAD), two pairs of a tiny
    workload: the exact metrics agree and every time metric has an interval."""
    if _git(ROOT, "rev-parse", "--is-inside-work-tree") != "true":
        pytest.skip("the checkout is not a git work tree")
    repo = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(repo)], check=True)
    settings = GateSettings.load(
        None, min_pairs=2, max_pairs=2, discard_pairs=0, warmup_runs=0,
        overrides=["model.num_layers_override=1", "workload.num_requests=3", "workload.output_len.low=2",
                   "workload.output_len.high=3"],
    )  # fmt: skip
    result = run_paired_gate(repo, "HEAD", settings, log=lambda _: None, out_dir=tmp_path / "out")
    assert result.pairs == 2 and len(result.baseline_reps) == 2
    by_name = {c.metric: c for c in result.checks}
    for exact in ("num_steps", "mean_tokens_per_step", "prefix_cache_hit_rate", "num_preemptions", "output_tokens"):
        assert by_name[exact].baseline == by_name[exact].candidate and by_name[exact].verdict == "ok"
    assert by_name["output_tokens"].baseline >= 6
    assert by_name["cpu_ms_per_token"].interval is not None
    saved = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert saved["pairs"] == 2 and saved["baseline_tree"].startswith(str(tmp_path))


# ---- generations ------------------------------------------------------------------------------
class _FakeWorker:
    """A worker that answers at once; reps carry its generation's placement luck."""

    started: list[tuple[str, int, list[str] | None]] = []
    jobs: list[dict[str, str] | None] = []  # the kernel pins each build_job call got

    def __init__(self, name, python, tree, env, cpus, log_dir, generation=0, args=None) -> None:
        self.name, self.generation = name, generation
        _FakeWorker.started.append((name, generation, args))

    def send(self, line: str) -> None:
        pass

    def receive(self, timeout_s: float) -> dict:
        return {"ready": True}

    def close(self) -> None:
        pass


def _fake_gate(monkeypatch, tmp_path: Path, worker: type | None = None, **changes) -> tuple:
    from workloads import paired_gate

    _FakeWorker.started = []
    monkeypatch.setattr(paired_gate, "Worker", worker or _FakeWorker)
    monkeypatch.setattr(paired_gate, "resolve_baseline", lambda repo, ref: "0" * 40)
    monkeypatch.setattr(paired_gate, "materialise", lambda repo, commit: tmp_path / "tree")
    monkeypatch.setattr(paired_gate, "python_for", lambda tree, repo, cache: ("python", "same"))
    monkeypatch.setattr(paired_gate, "extension_dir_for", lambda tree, repo, cache: None)
    monkeypatch.setattr(paired_gate, "kernel_digest", lambda tree: "k")
    monkeypatch.setattr(paired_gate, "perf_available", lambda: False)
    _FakeWorker.jobs = []
    monkeypatch.setattr(paired_gate, "build_job", lambda settings, pins=None: _FakeWorker.jobs.append(pins) or {})
    luck = [1.10, 0.95, 1.05, 0.98, 1.02, 1.0, 0.97, 1.03]
    monkeypatch.setattr(paired_gate, "timed_rep", lambda w, timeout, perf, scratch: {
        "cpu_ms_per_token": 5.0 * (luck[w.generation % 8] if w.name == "candidate" else 1.0)})
    settings = GateSettings.load(None, **changes)
    result = run_paired_gate(tmp_path, "HEAD", settings, log=lambda _: None, out_dir=tmp_path / "out")
    return result, _FakeWorker.started


def test_a_time_boxed_run_keeps_its_generations(monkeypatch, tmp_path):
    """min_pairs 8 in 4 generations: a run the time box stops at min_pairs still has 4 generations
    of 2 pairs (the old boundaries, over max_pairs + discard, gave it 2)."""
    result, started = _fake_gate(monkeypatch, tmp_path, min_pairs=8, max_pairs=16, generations=4,
                                 discard_pairs=1, time_box_s=0.0)  # fmt: skip
    assert result.generations == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (result.pairs, result.discarded) == (8, 1)
    assert sorted({g for _, g, _ in started}) == [0, 1, 2, 3] and len(started) == 8  # fresh workers each time
    check = next(c for c in result.checks if c.metric == "cpu_ms_per_token")
    assert check.generations == 4 and check.p_value is not None
    saved = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert saved["generation_of_pair"] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_an_unhurried_run_adds_generations_up_to_max_pairs(monkeypatch, tmp_path):
    result, started = _fake_gate(monkeypatch, tmp_path, min_pairs=8, max_pairs=15, generations=4,
                                 discard_pairs=0, time_box_s=1e9)  # fmt: skip
    assert result.generations == [g for g in range(8) for _ in range(2)][:15]  # the last one cut at max_pairs
    assert all(args is None for _, _, args in started)  # no test hook unless asked for
    assert GateSettings.load(None, min_pairs=2, generations=4).pairs_per_generation == 1


def test_the_test_slowdown_reaches_the_candidate_and_a_zero_hook_the_baseline(monkeypatch, tmp_path):
    from workloads import paired_gate

    result, _ = _fake_gate(monkeypatch, tmp_path, min_pairs=2, max_pairs=2, generations=1, discard_pairs=0)
    _FakeWorker.started = []
    settings = GateSettings.load(None, min_pairs=2, max_pairs=2, generations=1)
    paired_gate.run_paired_gate(tmp_path, "HEAD", settings, log=lambda _: None, out_dir=tmp_path / "out2",
                                candidate_slowdown=0.2)  # fmt: skip
    args = {name: a for name, _, a in _FakeWorker.started}
    assert args == {"baseline": ["--test-slowdown", "0"], "candidate": ["--test-slowdown", "0.2"]}
    seen = {}

    def fake_run(repo, against, settings, env, log, out_dir, candidate_slowdown):
        seen["slowdown"] = candidate_slowdown
        return result

    monkeypatch.setattr(gate_cli, "run_paired_gate", fake_run)
    assert gate_main(["--against", "HEAD", "--candidate-slowdown", "0.1"]) in (0, 1)
    assert seen["slowdown"] == 0.1


# ---- start-up probes pinned for both sides (issue 38, item 4) ---------------------------------
class _EnvWorker(_FakeWorker):
    envs: dict[str, dict[str, str]] = {}

    def __init__(self, name, python, tree, env, cpus, log_dir, generation=0, args=None) -> None:
        super().__init__(name, python, tree, env, cpus, log_dir, generation, args)
        _EnvWorker.envs[name] = env


@pytest.mark.parametrize("probe_says", [True, False])
def test_the_float32_kernel_probe_runs_once_and_both_sides_get_its_outcome(monkeypatch, tmp_path, probe_says):
    """oneDNN-vs-BLAS is decided by a timing probe at each process's start: two workers could run
    different float32 kernels on identical code. The gate probes once and pins it in the job both
    sides run (`kernels.float32_linear`), copying no environment variable."""
    from engine.kernels import cpu_linear

    monkeypatch.delenv("SERVELAB_ONEDNN_FP32", raising=False)
    calls = []
    monkeypatch.setattr(cpu_linear, "probe_onednn_float32_faster", lambda: calls.append(1) or probe_says)
    _EnvWorker.envs = {}
    _, started = _fake_gate(monkeypatch, tmp_path, worker=_EnvWorker, min_pairs=4, max_pairs=4, generations=2,
                            discard_pairs=0)  # fmt: skip
    want = "prepacked" if probe_says else "plain"
    assert _FakeWorker.jobs == [{"float32_linear": want}]  # the job both sides get
    assert all("SERVELAB_ONEDNN_FP32" not in e for e in _EnvWorker.envs.values())
    saved = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert any(f"pinned with kernels.float32_linear={want}" in n for n in saved["notes"]), saved["notes"]
    assert len(started) == 4 and len(calls) == 1  # once per gate run, never per worker (4 started here)


def test_a_pin_set_by_the_user_is_kept_and_dtype_auto_is_resolved_once(monkeypatch):
    from engine import platform
    from engine.config import KernelsConfig
    from workloads import paired_gate

    monkeypatch.setenv("SERVELAB_ONEDNN_FP32", "0")
    pins, note = paired_gate.pinned_probes(KernelsConfig())
    assert pins == {} and "kernels.float32_linear=plain from the configuration" in note
    job = paired_gate.build_job(GateSettings.load(None, overrides=["workload.num_requests=2"]), {"float32_linear": "plain"})
    assert job["engine"]["kernels"]["float32_linear"] == "plain"
    monkeypatch.setattr(platform, "fastest_cpu_dtype", lambda: ("bfloat16", "GEMM probe: bfloat16 1.20x float32"))
    auto = paired_gate.build_job(GateSettings.load(None, overrides=["model.dtype=auto", "workload.num_requests=2"]))
    assert auto["engine"]["model"]["dtype"] == "bfloat16"  # resolved once, in the job both sides get
    pinned = paired_gate.build_job(GateSettings.load(None, overrides=["workload.num_requests=2"]))
    assert pinned["engine"]["model"]["dtype"] == "float32"  # the ci_gate experiment's own pin
