"""SLO attribution finds the cause that was built into a run (issue 37, item 4).

Each test runs the in-process engine on the default model (one engine for the module; the
scheduler is swapped between runs by `EngineCore.reconfigure`) through the workbench's driver,
then attributes every request from its own steps (StepStats.members -> step_members.csv).

Each request is held to an SLO a margin above its own compute (what it costs alone, as the
attribution measures it): it misses only by what it paid beyond that, and the built cause is
large against the margin. Built causes, and who carries them (from the engine's own
record, not from timing):
- queueing: max_num_seqs=1, ten requests at once: all but the first one scheduled wait;
- prefill interference: three long decoders while long prompts arrive: the decoders whose decode
  steps ran another request's prompt;
- preemption: too few KV blocks: the requests the engine recomputed (members of kind recompute);
- front end: a wrapper delays the client's receipt of one request's tokens (asyncio: the loop
  stays free), as a slow response path would;
- harness lateness: a scripted pinned driver: the event loop blocks just before one request is
  due (it is sent late) and again when its first token comes, and reads its stream that late.
In each, every carrier is attributed to its cause and no other request is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import pytest

from analysis.attribution import Attribution, attribute
from analysis.record import TargetResult
from analysis.runfolder import steps_frame
from analysis.step_members import members_frame
from engine.config import EngineConfig
from workloads.driver import RunResult, run_workload
from workloads.spec import RequestSpec
from workloads.targets.base import OnToken
from workloads.targets.engine import EngineTarget

NUM_BLOCKS = 64  # 1,024 tokens of KV; the preemption run uses fewer of them
OWN = {"ttft": ("prefill",), "tpot": ("decode",), "e2el": ("prefill", "decode")}


def _spec(rid: str, arrival: float, prompt: int, out: int) -> RequestSpec:
    """Prompts that differ from their first token (no prefix hits between requests)."""
    salt = sum(map(ord, rid)) * 31
    return RequestSpec(rid, arrival, None, [200 + (i * 13 + salt) % 20000 for i in range(prompt)], prompt, out)


@dataclasses.dataclass
class _Engine:
    target: EngineTarget
    loop: asyncio.AbstractEventLoop  # every run on one loop: the client's output reader lives on it


@pytest.fixture(scope="module")
def engine() -> Iterator[_Engine]:
    cfg = EngineConfig()
    cfg.cache.num_blocks = NUM_BLOCKS
    cfg.scheduler.max_num_seqs = 8
    target = EngineTarget(cfg)
    target.load()
    loop = asyncio.new_event_loop()
    yield _Engine(target, loop)
    target.shutdown()
    loop.close()


def _run(engine: _Engine, specs: list[RequestSpec], wrap=None, num_blocks: int = NUM_BLOCKS,  # noqa: ANN001
         **sched: int) -> RunResult:
    """One run on the shared engine under scheduler settings `sched` (a fresh target per run keeps
    its steps apart); `wrap` builds a client-side wrapper around the target."""
    shared = engine.target
    core = shared.llm.client._thread_core.engine  # type: ignore[union-attr]  # idle between runs
    core.reconfigure(dataclasses.replace(shared.engine_config.scheduler, **sched), None, num_blocks)
    target = EngineTarget(shared.engine_config)
    target.adopt(shared.llm)
    try:
        return engine.loop.run_until_complete(run_workload(specs, wrap(target) if wrap else target))
    finally:
        target.release()


def _causes(res: RunResult, metric: str, margin_ms: float) -> tuple[dict[str, str], list[Attribution]]:
    """request id -> cause of `metric`, each request held to an SLO `margin_ms` above its own compute
    (what it costs alone, from the attribution itself): it misses by what it paid beyond that."""
    steps, members = steps_frame(res.steps or [], res.t0_wall), members_frame(res.steps or [])
    assert not members.empty, "the engine recorded no step members"
    alone = {a.request_id: a for a in attribute(res.records, steps, {f"{metric}_ms": 0.0}, members)}
    assert alone and all(a.source == "members" for a in alone.values())
    found = []
    for r in res.records:
        if r.request_id not in alone:
            continue  # no figure for this metric (TPOT of a one-token request)
        per = max(r.output_tokens - 1, 1) if metric == "tpot" else 1
        slo = _own_ms(alone[r.request_id], metric) / per + margin_ms
        found += attribute([r], steps, {f"{metric}_ms": slo}, members)
    return {a.request_id: a.causes[metric] for a in found}, found


def _own_ms(a: Attribution, metric: str) -> float:
    """The request's own compute in `metric`'s components (TTFT: its prefill; TPOT: its decode)."""
    parts = {"ttft": [a.ttft_ms], "tpot": [a.decode_ms], "e2el": [a.ttft_ms, a.decode_ms]}[metric]
    return sum(p.get(k, 0.0) for p in parts for k in OWN[metric])


def _check(causes: dict[str, str], cause: str, carriers: set[str], everyone: set[str], found) -> None:  # noqa: ANN001
    detail = {a.request_id: (a.causes, {k: round(v) for k, v in (a.ttft_ms | a.decode_ms).items()}) for a in found}
    assert carriers, "the run did not build the cause"
    for rid in carriers:
        assert causes.get(rid) == cause, (rid, detail.get(rid), detail)
    for rid in everyone - carriers:
        assert causes.get(rid) != cause, (rid, detail.get(rid), detail)


def _own_steps(res: RunResult) -> dict[str, list]:
    members = members_frame(res.steps or [])
    return {rid: g.sort_values("step") for rid, g in members.groupby("request_id")}


def test_queueing_max_num_seqs_1(engine: _Engine) -> None:
    specs = [_spec(f"r{i}", 0.0, 32, 8) for i in range(10)]
    res = _run(engine, specs, max_num_seqs=1)
    own = _own_steps(res)
    first_step = min(int(g["step"].min()) for g in own.values())
    carriers = {rid for rid, g in own.items() if int(g["step"].min()) > first_step}
    assert len(carriers) == 9
    for metric in ("ttft", "e2el"):
        causes, found = _causes(res, metric, margin_ms=50.0)
        _check(causes, "queueing", carriers, {s.request_id for s in specs}, found)


def test_prefill_interference_long_prompts_during_decodes(engine: _Engine) -> None:
    decoders = [_spec(f"d{i}", 0.0, 16, 48) for i in range(3)]
    prompts = [_spec(f"p{i}", 0.1 + 0.12 * i, 384, 1) for i in range(4)]
    res = _run(engine, decoders + prompts)
    own = _own_steps(res)
    members = members_frame(res.steps or [])
    prefill_steps = set(members[members["kind"] == "prefill"].groupby("step")["request_id"].apply(set).index)
    carriers = {rid for rid, g in own.items()
                if any(s in prefill_steps and not _own_prefill(members, s, rid)
                       for s in g[g["kind"] == "decode"]["step"])}  # fmt: skip
    causes, found = _causes(res, "tpot", margin_ms=1.0)
    _check(causes, "prefill_interference", carriers, {s.request_id for s in decoders + prompts}, found)
    assert carriers <= {d.request_id for d in decoders}


def _own_prefill(members, step: int, rid: str) -> bool:  # noqa: ANN001
    """Whether every prefill row of `step` is `rid`'s own."""
    rows = members[(members["step"] == step) & (members["kind"] == "prefill")]
    return bool((rows["request_id"] == rid).all())


def test_preemption_too_few_kv_blocks(engine: _Engine) -> None:
    # 9 blocks of 16 tokens: two 48-token prompts start, and as they grow one is preempted and
    # waits out the other's decode (each needs 7 blocks by its end)
    specs = [_spec(f"q{i}", 0.0, 48, 64) for i in range(4)]
    res = _run(engine, specs, num_blocks=9)
    members = members_frame(res.steps or [])
    carriers = set(members[members["kind"] == "recompute"]["request_id"])
    causes, found = _causes(res, "tpot", margin_ms=1.0)
    _check(causes, "preemption", carriers, {s.request_id for s in specs}, found)


class _Client:
    """The in-process engine seen from a client (token times are receipt times; the engine's
    timings ride along as the servelab timing extension gives them over HTTP), with scripted
    delays: `front_end` request ids get every chunk `delay_s` late, the event loop left free (a
    slow response path); `pinned` ids find the loop blocked `delay_s` just before they are due
    (sent late) and again when their first token comes, every chunk read `delay_s` late: a driver
    past its capacity."""

    name = "inprocess"

    def __init__(self, inner: EngineTarget, specs: list[RequestSpec], front_end: set[str], pinned: set[str],
                 delay_s: float) -> None:  # fmt: skip
        self.inner, self.front_end, self.pinned, self.delay_s = inner, front_end, pinned, delay_s
        self.due = {s.request_id: s.arrival_s for s in specs if s.request_id in pinned}

    async def start(self) -> None:
        await self.inner.start()
        loop = asyncio.get_running_loop()
        for at in self.due.values():  # the driver's run starts right after this returns
            loop.call_later(max(at - 0.05, 0.0), time.sleep, self.delay_s)

    async def stop(self) -> None:
        await self.inner.stop()

    def step_stats(self):  # noqa: ANN201
        return self.inner.step_stats()

    async def scrape_metrics(self) -> None:
        return None

    async def send(self, spec: RequestSpec, on_token: OnToken | None = None) -> TargetResult:
        pinned = spec.request_id in self.pinned
        first = [True]

        def seen(t: float, k: int) -> None:
            if pinned and first[0]:
                time.sleep(self.delay_s)  # the loop is busy elsewhere: the stream falls behind
            first[0] = False
            if on_token is not None:
                on_token(t, k)

        res = await self.inner.send(spec, seen)
        if spec.request_id in self.front_end:
            await asyncio.sleep(self.delay_s)
        if spec.request_id in self.front_end or pinned:  # every chunk read delay_s after the engine made it
            res.chunk_times = [t + self.delay_s for t in res.chunk_times]
            res.done_time = time.perf_counter()
        return res


def test_front_end_and_harness_lateness(engine: _Engine) -> None:
    """c1's response path is 1 s slow, c3's driver 1 s behind; c0 and c2 run clean. The delay is
    large against what a busy 2-core machine adds to a lone request's queue and front end."""
    specs = [_spec(f"c{i}", 1.6 * i, 32, 4) for i in range(4)]
    res = _run(engine, specs, wrap=lambda t: _Client(t, specs, front_end={"c1"}, pinned={"c3"}, delay_s=1.0))
    late = {r.request_id: r.lateness_s for r in res.records}
    assert late["c3"] > 0.5, late
    everyone = {s.request_id for s in specs}
    for metric in ("ttft", "e2el"):
        causes, found = _causes(res, metric, margin_ms=200.0)
        _check(causes, "front_end", {"c1"}, everyone, found)
        _check(causes, "harness_lateness", {"c3"}, everyone, found)
