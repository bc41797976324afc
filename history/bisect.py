"""`servelab-bisect GOOD BAD`: the first commit that made a metric worse, found by `git bisect`
with the paired gate as its test.

1. A worktree is made at BAD (`--in-place`: the checkout itself, which must be clean), and BAD
   is gated against GOOD: the step to find, its size Δ and interval. If BAD is not worse
   beyond noise there is nothing to bisect (exit 1); where its interval reaches below Δ / 2 it is
   measured again (pooled, within `--retries`). Each gate run measures `--pairs` pairs (default
   40, over the gate's 16: a bisection counts gate runs, not seconds).
2. `git bisect start BAD GOOD`; at each commit git checks out, the gate runs against GOOD (the
   same paired measurement, its baseline trees reused) and the commit is classified by where the
   interval of its change lies against the threshold (default Δ / 2): wholly above, bad; wholly
   below, good. An interval across the threshold is weighed by the likelihood of its change under
   the two answers a commit can have, no change (GOOD's 0) or the whole step (Δ, as measured: its
   error adds to the commit's), as normal errors whose spreads the intervals give: bad where the
   step is `--odds` (default 10) times as likely as no change, good where no change is that much
   likelier, else inconclusive; so is a gate that gave no figure. An inconclusive commit is
   measured again (`--retries`), then `git bisect skip`ped: never guessed. A retry does not replace the run before it: the commit is
   judged on the pairs of all its runs together (`pooled_change`: twice the generations, a
   narrower interval).
3. git names the first bad commit; `servelab-explain` runs on it against its parent (which
   operators, which phases) and its answer is printed after the verdict. bisect.json holds
   every gate run (commit, change, interval, class, seconds) and git's bisect log.

The gate command is a template (`--gate-cmd`) with {good}, {repo}, {out}, {bin} (this Python's
bin folder) and {python}; it must write {out}/gate.json as `servelab-gate --against` does.
Exit codes: 0 found, 1 no regression between GOOD and BAD, 2 usage error, 3 undecided (every
commit left was skipped; git lists the candidates).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import IO

from history.machine import git

DEFAULT_GATE_CMD = ("{bin}/servelab-gate --against {good} --repo {repo} --out {out} --explain-repeats 0 "
                    "--pairs {pairs} --time-box-s {time_box_s}")
# Pairs per gate run, and its time box. The gate's own defaults (16 pairs, 230 s) suit a pull request;
# a bisection counts gate runs, and on the 2-core machine 16 pairs measured a +10% step as +9.5%
# (+1.5% .. +25.9%) in 90 s (2026-12-07), as wide as the step, so that the threshold (half the step)
# was itself unknown. The interval narrows as 1/sqrt(pairs): 40 pairs, about 220 s there.
DEFAULT_PAIRS = 40
DEFAULT_TIME_BOX_S = 300.0
DEFAULT_EXPLAIN_CMD = "{bin}/servelab-explain {parent} {commit} --repo {repo} --out {out}"
# The likelihood ratio that decides a commit whose interval straddles the threshold. At 10, with a
# gate whose 95% interval is +-10 points (the 2-core machine's, 2026-12-07) for the commit and for
# the step, and a +12% step, a commit without the change is called bad 1% of the time and one with
# it good 2%; one gate run decides 3 (no change) to 5 (the step) commits in 10, where the interval
# rule alone decides about 2.
DEFAULT_ODDS = 10.0
CONFIDENCE = 0.95  # the paired gate's bootstrap interval (workloads/paired_gate.py, `bootstrap`)
Z_GATE = NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)  # 1.96


@dataclass(frozen=True)
class BisectSettings:
    metric: str = "cpu_ms_per_token"
    gate_cmd: str = DEFAULT_GATE_CMD
    explain_cmd: str | None = DEFAULT_EXPLAIN_CMD  # None: no explanation
    retries: int = 1  # further gate runs of an inconclusive commit before it is skipped
    threshold: float | None = None  # a worsening beyond this is bad; None: half the step GOOD -> BAD
    in_place: bool = False
    odds: float = DEFAULT_ODDS  # the likelihood ratio step : no change that decides; 0: the interval rule alone
    pairs: int = DEFAULT_PAIRS  # {pairs} of the gate command
    time_box_s: float = DEFAULT_TIME_BOX_S  # {time_box_s} of the gate command


@dataclass(frozen=True, slots=True)
class Step:
    commit: str
    attempt: int
    worse: float | None  # the change in the bad direction (a slowdown > 0), None: the gate gave none
    interval: tuple[float, float] | None  # in the bad direction too
    verdict: str  # "bad" | "good" | "inconclusive" | "step" (the GOOD -> BAD measurement)
    seconds: float
    note: str = ""
    odds: float | None = None  # the likelihood ratio, the step against no change, where it decided or was weighed


@dataclass
class BisectResult:
    good: str
    bad: str
    metric: str
    step: Step | None = None
    threshold: float | None = None
    first_bad: str | None = None
    candidates: list[str] = field(default_factory=list)  # when undecided: git's list
    steps: list[Step] = field(default_factory=list)
    explain: str = ""
    log: str = ""

    @property
    def gate_runs(self) -> int:
        return len(self.steps)

    def to_json(self) -> dict[str, object]:
        return {**{k: v for k, v in asdict(self).items() if k != "steps"}, "gate_runs": self.gate_runs,
                "steps": [asdict(s) for s in self.steps]}  # fmt: skip


def _format(template: str, **values: str) -> list[str]:
    quoted = {k: shlex.quote(v) for k, v in values.items()}
    return shlex.split(template.format(bin=shlex.quote(str(Path(sys.executable).parent)),
                                       python=shlex.quote(sys.executable), **quoted))  # fmt: skip


def _run_group(cmd: list[str], cwd: Path, log: IO[str]) -> int:
    """Runs the gate in a process group of its own and waits; its exit code. Stopped from outside
    (Ctrl-C, or SIGTERM under `sigterm_stops`), the whole group is killed: the gate and the
    workers it started, which would otherwise go on measuring on the machine's cores."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """Inside, SIGTERM ends the bisection as Ctrl-C does: the gate's group killed, `git bisect reset`
    run and the worktree removed on the way out (the `finally` blocks), exit status 143. The previous
    handler is put back after."""
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def read_change(gate_json: Path, metric: str) -> tuple[float, tuple[float, float] | None]:
    """The metric's change and interval from a gate.json, turned so that worse is positive."""
    data = json.loads(gate_json.read_text())
    for c in data.get("checks", []):
        if c.get("metric") == metric:
            sign = -1.0 if (c.get("rule") or {}).get("direction") == "higher" else 1.0
            iv = c.get("interval")
            interval = None if not iv else tuple(sorted((sign * float(iv[0]), sign * float(iv[1]))))
            return sign * float(c["change"]), interval  # type: ignore[return-value]
    raise KeyError(f"{gate_json}: no check for metric {metric!r}")


def pooled_change(gate_jsons: Sequence[Path], metric: str,
                  ) -> tuple[float, tuple[float, float], int] | None:  # fmt: skip
    """(change, interval, generations) of the metric over the pairs of several gate runs of one commit
    against GOOD, turned so that worse is positive: every run's generations kept apart (each run
    started fresh workers) and resampled together as the gate resamples one run's
    (workloads.gate_stats.paired_change). None where a gate.json lacks its pairs (`baseline_reps`,
    `candidate_reps`, `generation_of_pair`: a stand-in gate, or a gate from before them)."""
    base: list[float] = []
    cand: list[float] = []
    gens: list[int] = []
    sign = 1.0
    for path in gate_jsons:
        data = json.loads(path.read_text())
        a, b, g = data.get("baseline_reps"), data.get("candidate_reps"), data.get("generation_of_pair")
        check = next((c for c in data.get("checks", []) if c.get("metric") == metric), None)
        if check is None or not a or not b or g is None or not len(a) == len(b) == len(g):
            return None
        if any(r.get(metric) is None for r in [*a, *b]):
            return None
        sign = -1.0 if (check.get("rule") or {}).get("direction") == "higher" else 1.0
        offset = max(gens) + 1 if gens else 0
        base += [float(r[metric]) for r in a]
        cand += [float(r[metric]) for r in b]
        gens += [offset + int(x) for x in g]
    from workloads.gate_stats import paired_change

    est, _ = paired_change(base, cand, generations=gens)
    low, high = sorted((sign * est.low, sign * est.high))
    return sign * est.point, (low, high), len(set(gens))


def _sd(interval: tuple[float, float], confidence: float) -> float:
    """The standard error a normal interval of this width and confidence has (width / 2 z)."""
    z = Z_GATE if confidence == CONFIDENCE else NormalDist().inv_cdf(0.5 + confidence / 2)
    return (interval[1] - interval[0]) / (2 * z)


def step_odds(worse: float, interval: tuple[float, float], step: float,
              step_interval: tuple[float, float] | None = None, confidence: float = CONFIDENCE) -> float:  # fmt: skip
    """How many times likelier the change `worse` (its interval `interval`) is if the commit carries
    the whole step than if it carries none. No change: a normal density centred on 0 with the
    spread the interval gives. The step: the step GOOD -> BAD was itself measured (`step`, its
    interval `step_interval`), so the commit's figure is compared with that measurement, the
    two errors added (a normal centred on `step` with both spreads): a step measured high does
    not make a bad commit that measures lower look like no change."""
    sd = _sd(interval, confidence)
    sd_step = math.hypot(sd, _sd(step_interval, confidence)) if step_interval is not None else sd
    if sd <= 0 or sd_step <= 0:
        return math.inf if abs(worse - step) < abs(worse) else 0.0
    log_ratio = worse**2 / (2 * sd**2) - (worse - step) ** 2 / (2 * sd_step**2) + math.log(sd / sd_step)
    return math.exp(min(max(log_ratio, -700.0), 700.0))


def classify(worse: float | None, interval: tuple[float, float] | None, threshold: float,
             step: float | None = None, odds: float = DEFAULT_ODDS,
             step_interval: tuple[float, float] | None = None) -> tuple[str, float | None]:  # fmt: skip
    """(verdict, the likelihood ratio where it was weighed): the interval against the threshold
    first; an interval across it by `step_odds` against `odds` (where a step and odds are given)."""
    if worse is None or interval is None:
        return "inconclusive", None
    if interval[0] > threshold:
        return "bad", None
    if interval[1] < threshold:
        return "good", None
    if step is None or step <= 0 or odds <= 1:
        return "inconclusive", None
    ratio = step_odds(worse, interval, step, step_interval)
    if ratio >= odds:
        return "bad", ratio
    if ratio <= 1 / odds:
        return "good", ratio
    return "inconclusive", ratio


def wider_than_itself(step: Step) -> bool:
    """Whether the step GOOD -> BAD was measured worse beyond noise but with an interval reaching
    below half its size: the threshold (half the step) is then as unsure as the commits it would
    sort, and the likelihood of the step is spread thin. Such a step is measured again (pooled),
    within `--retries`: one more gate run there saves several at the commits."""
    if step.worse is None or step.interval is None:
        return False
    return 0 < step.interval[0] < step.worse / 2


def _odds_note(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"the step {ratio:.3g} times as likely as no change" if ratio >= 1 else \
        f"no change {1 / ratio:.3g} times as likely as the step"


class Bisector:
    """One bisection (module docstring); `log` prints progress."""

    def __init__(self, repo: Path, good: str, bad: str, settings: BisectSettings, out: Path,
                 log: Callable[[str], None] = print,
                 on_gate: Callable[[Path, Path], None] | None = None) -> None:  # fmt: skip
        self.repo, self.settings, self.out, self.log = repo.resolve(), settings, out, log
        self.on_gate = on_gate  # called with (gate.json, tree) after every gate run that wrote one
        self.good = git(self.repo, "rev-parse", "--verify", f"{good}^{{commit}}")
        self.bad = git(self.repo, "rev-parse", "--verify", f"{bad}^{{commit}}")
        ancestry = ["git", "-C", str(self.repo), "merge-base", "--is-ancestor", self.good, self.bad]
        if self.good == self.bad or subprocess.run(ancestry).returncode != 0:
            raise ValueError(f"GOOD {good} is not an ancestor of BAD {bad}")
        self.result = BisectResult(self.good, self.bad, settings.metric)

    def gate(self, tree: Path, commit: str, attempt: int, earlier: list[Path] | None = None) -> Step:
        """One gate run of `commit`. `earlier`: the gate.json files of its previous runs; the commit
        is then classified on all their pairs together (`pooled_change`) where every file has them,
        else on this run's own figure. The file of this run is appended to `earlier`."""
        step_dir = self.out / f"gate-{len(self.result.steps):02d}-{commit[:10]}"
        shutil.rmtree(step_dir, ignore_errors=True)
        step_dir.mkdir(parents=True)
        cmd = _format(self.settings.gate_cmd, good=self.good, repo=str(tree), out=str(step_dir),
                      pairs=str(self.settings.pairs), time_box_s=f"{self.settings.time_box_s:g}")  # fmt: skip
        t0 = time.perf_counter()
        with open(step_dir / "gate.log", "w") as logf:
            code = _run_group(cmd, tree, logf)
        seconds = time.perf_counter() - t0
        gate_json = step_dir / "gate.json"
        if code not in (0, 1) or not gate_json.is_file():
            return Step(commit, attempt, None, None, "inconclusive", seconds,
                        f"the gate exited {code} without a figure")  # fmt: skip
        if self.on_gate is not None:
            self.on_gate(gate_json, tree)
        worse, interval = read_change(gate_json, self.settings.metric)
        note = ""
        if earlier:  # a retry: this run's pairs join those of the runs before it
            pooled = pooled_change([*earlier, gate_json], self.settings.metric)
            if pooled is not None:
                worse, interval, generations = pooled
                note = f"pooled over {len(earlier) + 1} gate runs ({generations} generations)"
        if earlier is not None:
            earlier.append(gate_json)
        threshold = self.result.threshold if self.result.threshold is not None else 0.0
        measured = self.result.step  # None while the step itself is measured
        verdict, ratio = classify(worse, interval, threshold, measured.worse if measured else None, self.settings.odds,
                                  measured.interval if measured else None)  # fmt: skip
        return Step(commit, attempt, worse, interval, verdict, seconds, note, ratio)

    def measure(self, tree: Path, commit: str, again: Callable[[Step], bool] | None = None) -> Step:
        """The commit's class, retried while inconclusive (or while `again` says so), each retry
        classified on the pairs of all its runs so far; every gate run is kept in the result."""
        runs: list[Path] = []
        step = self.gate(tree, commit, 0, runs)
        self._keep(step)
        for attempt in range(1, self.settings.retries + 1):
            if step.verdict != "inconclusive" and not (again is not None and again(step)):
                break
            step = self.gate(tree, commit, attempt, runs)
            self._keep(step)
        return step

    def _keep(self, step: Step) -> None:
        self.result.steps.append(step)
        fig = "no figure" if step.worse is None else f"{step.worse:+.1%}"
        iv = "" if step.interval is None else f" ({step.interval[0]:+.1%} .. {step.interval[1]:+.1%})"
        notes = [n for n in (_odds_note(step.odds), step.note) if n]
        self.log(f"bisect: gate run {len(self.result.steps)}: {step.commit[:10]} {fig}{iv} -> {step.verdict} "
                 f"in {step.seconds:.1f} s{''.join('; ' + n for n in notes)}")  # fmt: skip

    @contextmanager
    def tree(self) -> Iterator[Path]:
        if self.settings.in_place:
            if git(self.repo, "status", "--porcelain", "--untracked-files=no"):
                raise ValueError(f"{self.repo} has uncommitted changes: commit or stash them, or leave out --in-place")
            start = git(self.repo, "rev-parse", "--abbrev-ref", "HEAD")
            git(self.repo, "checkout", "-q", "--detach", self.bad)
            try:
                yield self.repo
            finally:
                git(self.repo, "checkout", "-q", start if start != "HEAD" else self.bad, check=False)
            return
        tmp = Path(tempfile.mkdtemp(prefix="servelab-bisect-")) / self.repo.name
        git(self.repo, "worktree", "add", "-q", "--detach", str(tmp), self.bad)
        try:
            yield tmp
        finally:
            git(self.repo, "worktree", "remove", "--force", str(tmp), check=False)
            shutil.rmtree(tmp.parent, ignore_errors=True)

    def run(self) -> BisectResult:
        self.out.mkdir(parents=True, exist_ok=True)
        with self.tree() as tree:
            step = self.measure(tree, self.bad, again=wider_than_itself)
            self.result.step = step
            if step.worse is None or step.interval is None or step.interval[0] <= 0:
                self.log(f"bisect: BAD {self.bad[:10]} is not worse than GOOD {self.good[:10]} beyond noise in "
                         f"{self.settings.metric}: nothing to bisect")  # fmt: skip
                return self.result
            self.result.threshold = self.settings.threshold if self.settings.threshold is not None else step.worse / 2
            self.log(f"bisect: the step is {step.worse:+.1%}; a commit is bad above {self.result.threshold:+.1%}"
                     + (f", or where the step is {self.settings.odds:g} times as likely as no change"
                        if self.settings.odds > 1 else ""))  # fmt: skip
            self._bisect(tree)
        return self.result

    def _bisect(self, tree: Path) -> None:
        out = git(tree, "bisect", "start", self.bad, self.good)
        try:
            while True:
                done = self._finished(out)
                if done:
                    break
                head = git(tree, "rev-parse", "HEAD")
                verdict = self.measure(tree, head).verdict
                out = git(tree, "bisect", "skip" if verdict == "inconclusive" else verdict, check=False)
        finally:
            self.result.log = git(tree, "bisect", "log", check=False)
            git(tree, "bisect", "reset", check=False)

    def _finished(self, out: str) -> bool:
        if "is the first bad commit" in out:
            self.result.first_bad = out.split()[0]
            return True
        if "only 'skip'ped commits left" in out:
            hexdigits = set("0123456789abcdef")
            self.result.candidates = [w for w in out.split() if len(w) == 40 and set(w) <= hexdigits]
            return True
        return False

    def explain(self) -> str:
        """servelab-explain's answer for the first bad commit against its parent ('' when none)."""
        if self.result.first_bad is None or not self.settings.explain_cmd:
            return ""
        parent = git(self.repo, "rev-parse", f"{self.result.first_bad}^")
        cmd = _format(self.settings.explain_cmd, parent=parent, commit=self.result.first_bad, repo=str(self.repo),
                      out=str(self.out / "explain"))  # fmt: skip
        proc = subprocess.run(cmd, cwd=self.repo, capture_output=True, text=True)
        text = proc.stdout.strip() if proc.returncode == 0 else f"explain failed (exit {proc.returncode}): " + (
            (proc.stderr or proc.stdout).strip().splitlines() or [""])[-1]
        self.result.explain = text
        return text
