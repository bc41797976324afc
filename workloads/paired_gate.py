"""The paired CI gate: the gate workload on a baseline commit and on this checkout, alternately.

`run_paired_gate(repo, against, settings)`:

1. resolves `against` to a commit and checks it out next to the checkout
   (`workloads.gate_trees`), with the interpreter and C++ extension folder it needs;
2. builds the job once (conf/gate/paired.yaml `experiment` + `overrides`, composed as
   `servelab-run` would, prompts as token ids), so both sides get identical requests;
3. starts one worker per tree (`workloads/gate_worker.py`: loads that tree's engine once,
   runs the warm-up), with the same threads, CPU affinity and environment;
4. runs pairs (baseline then candidate, the next pair candidate then baseline, ...) in
   generations: each generation is a fresh pair of worker processes that runs
   `pairs_per_generation` pairs (`min_pairs // generations`; generation 0 first runs the
   `discard_pairs` pairs that are dropped). A process keeps the placement it was given (its
   pages, their cache sets) for its life, and with one worker per side for the whole run,
   identical code measured forward_ms -7.4% (-11.9% .. -1.4%), +11.9% (-1.1% .. +18.4%) and
   +9.9% (+6.0% .. +16.0%: a false regression) in three runs (2-core Zen 4 KVM guest, 16
   pairs each). Fresh processes turn that bias into spread between generations, and the
   verdict (`workloads.gate_stats`) resamples generations, the independent units. Generations
   start until `max_pairs`; past `min_pairs`, one starts only when it fits in the time box, so
   a time-boxed run still has the `generations` of its design, each of full size.

Where `perf stat` counts instructions, each rep's user-space instructions per output token are
reported too (deterministic to a fraction of a percent on one machine).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import yaml

import conf
from engine.config import KernelsConfig
from workloads.gate_stats import MetricRule, PairedCheck, judge_all
from workloads.gate_trees import extension_dir_for, kernel_digest, materialise, python_for, resolve_baseline

DEFAULT_SETTINGS = Path(conf.__file__).parent / "gate" / "paired.yaml"
WORKER = Path(__file__).with_name("gate_worker.py")
# Runs the worker script by path with the tree as sys.path[0] (python -c puts the working
# directory first), not the folder holding the script.
RUN_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
# Never inherited by a worker: baseline trees from before the gate worker's --test-slowdown read
# it inside their engine's forward.
TEST_ONLY_ENV = ("SERVELAB_TEST_SLOWDOWN",)


@dataclass
class GateSettings:
    """conf/gate/paired.yaml."""

    experiment: str = "ci_gate"
    overrides: list[str] = field(default_factory=list)
    threads: int = 1
    cpus: list[int] | None = None  # CPU affinity of both workers (None: the gate's own)
    warmup_runs: int = 1
    min_pairs: int = 6
    max_pairs: int = 30
    discard_pairs: int = 1
    generations: int = 4  # fresh worker pairs by min_pairs; more start up to max_pairs (module docstring)
    time_box_s: float = 230.0
    rep_timeout_s: float = 120.0
    bootstrap: dict[str, Any] = field(default_factory=lambda: {"resamples": 2000, "confidence": 0.95, "seed": 0})
    metrics: dict[str, MetricRule] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None = None, **changes: Any) -> GateSettings:
        raw = yaml.safe_load(Path(path or DEFAULT_SETTINGS).read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"paired gate config {path or DEFAULT_SETTINGS}: unknown key(s) {unknown}")
        raw["metrics"] = {k: MetricRule.from_dict(k, v) for k, v in (raw.get("metrics") or {}).items()}
        settings = cls(**raw)
        for key, value in changes.items():
            if value is not None:
                setattr(settings, key, value)
        if settings.min_pairs < 2 or settings.max_pairs < settings.min_pairs:
            raise ValueError(f"paired gate: need 2 <= min_pairs <= max_pairs, got {settings.min_pairs}, "
                             f"{settings.max_pairs}")  # fmt: skip
        if settings.generations < 1:
            raise ValueError(f"paired gate: need generations >= 1, got {settings.generations}")
        return settings

    @property
    def pairs_per_generation(self) -> int:
        """Pairs each worker generation runs: `min_pairs` pairs make `generations` generations
        (at most `min_pairs` generations of one pair)."""
        return max(1, self.min_pairs // min(self.generations, self.min_pairs))


@dataclass
class GateResult:
    baseline_commit: str
    baseline_tree: str
    checks: list[PairedCheck]
    baseline_reps: list[dict[str, float]]
    candidate_reps: list[dict[str, float]]
    pairs: int
    discarded: int
    elapsed_s: float
    notes: list[str]
    generations: list[int] = field(default_factory=list)  # generation of each kept pair
    out_dir: str = ""  # where gate.json and the workers' logs are

    @property
    def regressed(self) -> bool:
        return any(c.regressed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": "fail" if self.regressed else "pass",
            "baseline_commit": self.baseline_commit,
            "baseline_tree": self.baseline_tree,
            "pairs": self.pairs,
            "discarded_pairs": self.discarded,
            "generation_of_pair": self.generations,
            "elapsed_s": self.elapsed_s,
            "notes": self.notes,
            "checks": [asdict(c) | {"rule": asdict(c.rule)} for c in self.checks],
            "baseline_reps": self.baseline_reps,
            "candidate_reps": self.candidate_reps,
        }


def build_job(settings: GateSettings, kernel_pins: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The requests (token ids) and engine sections both workers run, composed as servelab-run does;
    `kernel_pins`: `kernels` fields set over the composed ones (`pinned_probes`)."""
    from conf.schema import RunConfig, compose_typed
    from engine.platform import resolve_engine_dtype
    from engine.tokenizer import get_tokenizer
    from workloads.factory import build_workload
    from workloads.targets.build import max_model_len

    cfg = compose_typed(RunConfig, "run", [f"experiment={settings.experiment}", *settings.overrides])
    engine_config = cfg.engine_config()
    engine_config.device.num_threads = settings.threads
    for key, value in (kernel_pins or {}).items():
        setattr(engine_config.kernels, key, value)
    # "auto" resolved once, here: on a CPU with avx512_bf16 and no AMX a GEMM probe decides it at each
    # process's start (engine/platform.py), and noise could tip it one way in one worker, the other way
    # in the next. Both sides run the dtype the job names.
    engine_config.model.dtype = resolve_engine_dtype(engine_config.model.dtype, engine_config.device.device,
                                                     engine_config.model.model)  # fmt: skip
    specs, _ = build_workload(cfg.workload, get_tokenizer(engine_config.model), max_model_len(engine_config))
    specs = [s for s in specs if not s.is_warmup]
    if any(s.prompt_token_ids is None for s in specs):
        raise ValueError(f"paired gate: experiment {settings.experiment} must set workload.prompt_as_token_ids")
    sections = {f.name: asdict(getattr(engine_config, f.name)) for f in fields(engine_config)}
    return {
        "engine": sections,
        "requests": [{"prompt_token_ids": list(s.prompt_token_ids or []), "max_tokens": s.max_tokens} for s in specs],
        "threads": settings.threads,
        "warmup_runs": settings.warmup_runs,
    }


def gate_kernels(settings: GateSettings) -> KernelsConfig:
    """The `kernels` section the gate's experiment composes to (its environment overrides applied)."""
    from conf.schema import RunConfig, compose_typed

    cfg = compose_typed(RunConfig, "run", [f"experiment={settings.experiment}", *settings.overrides])
    kernels = cfg.kernels
    kernels.apply_environment()
    return kernels


def pinned_probes(kernels: KernelsConfig) -> tuple[dict[str, str], str]:
    """({kernels field: value}, note): the start-up probes whose outcome depends on machine noise,
    decided once in the gate's process and pinned in the job both sides run, so that both run the
    same kernels: the float32 linears' oneDNN-vs-BLAS probe (engine/kernels/cpu_linear.py), pinned
    as `kernels.float32_linear` (kept where the configuration, or its environment override
    SERVELAB_ONEDNN_FP32, names one already). A baseline tree from before `KernelsConfig` reads the
    variable instead: its worker sets it from the job (workloads/gate_worker.py)."""
    if kernels.float32_linear != "auto":
        return {}, f"float32 linears: kernels.float32_linear={kernels.float32_linear} from the configuration, both sides"
    from engine.kernels.cpu_linear import probe_onednn_float32_faster

    value = "prepacked" if probe_onednn_float32_faster() else "plain"
    kernel = "oneDNN prepacked" if value == "prepacked" else "the plain BLAS"
    return {"float32_linear": value}, (f"float32 linears: {kernel} on both sides (probed once here, "
                                       f"pinned with kernels.float32_linear={value})")


def worker_env(tree: Path, threads: int, extension_dir: Path | None, extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of one worker: identical for both sides but for the tree and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in TEST_ONLY_ENV}
    env |= {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}  # fmt: skip
    if extension_dir is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extension_dir)
    return env | dict(extra)


class Worker:
    """One tree's worker process, driven over its stdin/stdout (see workloads/gate_worker.py)."""

    def __init__(self, name: str, python: str, tree: Path, env: dict[str, str], cpus: list[int] | None,
                 log_dir: Path, generation: int = 0, args: list[str] | None = None) -> None:  # fmt: skip
        self.name = name
        self.log_path = log_dir / (f"{name}.log" if generation == 0 else f"{name}-{generation}.log")
        self._log = self.log_path.open("w")
        affinity = set(cpus) if cpus else None
        self.proc = subprocess.Popen(
            [python, "-c", RUN_SCRIPT, str(WORKER), *(args or [])], cwd=tree, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            preexec_fn=(lambda: os.sched_setaffinity(0, affinity)) if affinity else None,  # type: ignore[arg-type]
        )

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline() if ready else ""
        if not line:
            alive = self.proc.poll() is None
            why = f"no answer in {timeout_s:.0f} s" if alive and not ready else f"exited ({self.proc.poll()})"
            raise RuntimeError(f"{self.name} worker {why}: {self.tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name} worker: {reply['error']}")
        return reply

    def tail(self) -> str:
        self._log.flush()
        lines = [s for s in self.log_path.read_text(errors="replace").splitlines() if s.strip()]
        return lines[-1][:300] if lines else f"see {self.log_path}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def perf_available() -> bool:
    """True when `perf stat` counts user-space instructions here (not in most VMs)."""
    if shutil.which("perf") is None:
        return False
    res = subprocess.run(["perf", "stat", "-x,", "-e", "instructions:u", "true"], capture_output=True, text=True)
    return parse_perf_instructions(res.stderr) is not None


def parse_perf_instructions(text: str) -> float | None:
    """The instruction count in `perf stat -x,` output; None when not counted or not supported."""
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) >= 3 and parts[2].startswith("instructions"):
            try:
                return float(parts[0])
            except ValueError:
                return None
    return None


def timed_rep(worker: Worker, timeout_s: float, perf: bool, scratch: Path) -> dict[str, float]:
    """One rep on `worker`; adds instructions per output token when `perf`."""
    counter = None
    if perf:
        out = scratch / f"perf-{worker.name}.txt"
        counter = subprocess.Popen(["perf", "stat", "-x,", "-e", "instructions:u", "-p", str(worker.proc.pid),
                                    "-o", str(out)], stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(0.05)  # let perf attach before the rep starts
    worker.send("run")
    rep = worker.receive(timeout_s)
    if counter is not None:
        counter.send_signal(signal.SIGINT)
        counter.wait(timeout=10)
        count = parse_perf_instructions(out.read_text())
        if count is not None:
            rep["instructions_per_token"] = count / max(rep.get("output_tokens", 1), 1)
    return rep


Side = tuple[str, Path, dict[str, str]]  # a worker's interpreter, tree and environment


def gate_sides(repo: Path, against: str, settings: GateSettings, candidate_env: Mapping[str, str] | None = None,
               ) -> tuple[str, Path, dict[str, Side], list[str]]:  # fmt: skip
    """(baseline commit, its tree, {"baseline"|"candidate": Side}, notes): `against` checked out
    beside `repo` with the interpreter and C++ extension folder it needs; the candidate is `repo`."""
    commit = resolve_baseline(repo, against)
    tree = materialise(repo, commit)
    cache = tree.parent / "cache"
    python, why_python = python_for(tree, repo, cache)
    ext_dir = extension_dir_for(tree, repo, cache)
    notes = [f"baseline {commit[:12]} at {tree}", f"baseline python: {why_python}",
             "C++ kernels: " + (f"baseline built separately in {ext_dir}" if ext_dir else
                                "same sources, shared build" if kernel_digest(tree) == kernel_digest(repo) else
                                "changed; builds named by their sources, in the shared cache")]  # fmt: skip
    sides = {"baseline": (python, tree, worker_env(tree, settings.threads, ext_dir, {})),
             "candidate": (sys.executable, repo, worker_env(repo, settings.threads, None, dict(candidate_env or {})))}
    return commit, tree, sides, notes


def run_paired_gate(
    repo: Path, against: str, settings: GateSettings, candidate_env: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print, out_dir: Path | None = None, candidate_slowdown: float = 0.0,
) -> GateResult:
    """See the module docstring. Raises gate_trees.NoHistory when there is nothing to compare with.

    `candidate_slowdown` (TEST ONLY, for measuring the gate's power): the candidate's worker
    spins after each forward for that fraction of the forward's CPU time (gate_worker.py
    `--test-slowdown`); the baseline's then installs the same hook at 0, so both pay its cost."""
    t0 = time.perf_counter()
    repo = repo.resolve()
    commit, tree, sides, notes = gate_sides(repo, against, settings, candidate_env)
    pins, pin_note = pinned_probes(gate_kernels(settings))
    notes.append(pin_note)
    perf = perf_available()
    notes.append("perf stat: counting instructions" if perf else "perf stat: no instruction counter here (not reported)")
    if candidate_slowdown:
        notes.append(f"TEST ONLY: the candidate's forward slowed by {candidate_slowdown:.0%}")
    for n in notes:
        log(n)
    scratch = Path(out_dir or tempfile.mkdtemp(prefix="servelab-gate-"))
    scratch.mkdir(parents=True, exist_ok=True)
    slow = {"baseline": ["--test-slowdown", "0"], "candidate": ["--test-slowdown", f"{candidate_slowdown}"]}

    def start(generation: int) -> dict[str, Worker]:
        """Both sides' workers, started in an order that alternates with the generation."""
        names = ("baseline", "candidate") if generation % 2 == 0 else ("candidate", "baseline")
        return {n: Worker(n, *sides[n], settings.cpus, scratch, generation, slow[n] if candidate_slowdown else None)
                for n in names}  # fmt: skip

    def ready(workers: dict[str, Worker], job: str) -> None:
        for w in workers.values():
            w.send(job)
        for w in workers.values():
            w.receive(settings.rep_timeout_s * (settings.warmup_runs + 1) + 600)  # model load, C++ build

    reps: dict[str, list[dict[str, float]]] = {"baseline": [], "candidate": []}
    labels: list[int] = []  # the generation of each kept pair
    per_generation = settings.pairs_per_generation
    generation, pair, workers = 0, 0, start(0)
    try:
        job = json.dumps(build_job(settings, pins))  # while the workers import torch
        ready(workers, job)
        log(f"workers ready after {time.perf_counter() - t0:.0f} s; {per_generation} pair(s) per generation of "
            f"workers, {-(-settings.min_pairs // per_generation)} or more generations")  # fmt: skip
        g0 = t0
        while True:
            todo = min(per_generation, settings.max_pairs - len(labels)) + (settings.discard_pairs if generation == 0 else 0)
            for k in range(todo):
                order = ("baseline", "candidate") if pair % 2 == 0 else ("candidate", "baseline")
                measured = {side: timed_rep(workers[side], settings.rep_timeout_s, perf, scratch) for side in order}
                pair += 1
                if generation == 0 and k < settings.discard_pairs:
                    continue
                for side in order:
                    reps[side].append(measured[side])
                labels.append(generation)
            now = time.perf_counter()
            generation_s, g0 = now - g0, now  # the next generation is expected to take as long
            if len(labels) >= settings.max_pairs:
                break
            if len(labels) >= settings.min_pairs and now - t0 + generation_s > settings.time_box_s:
                break
            for w in workers.values():  # fresh processes for the next generation
                w.close()
            generation += 1
            workers = start(generation)
            ready(workers, job)
    finally:
        for w in workers.values():
            w.close()
    base, cand = reps["baseline"], reps["candidate"]
    checks = judge_all(settings.metrics, base, cand, settings.bootstrap, labels)
    result = GateResult(commit, str(tree), checks, base, cand, len(cand), pair - len(cand),
                        time.perf_counter() - t0, notes, labels, str(scratch))  # fmt: skip
    (scratch / "gate.json").write_text(json.dumps(result.to_json(), indent=2, default=float))
    return result
