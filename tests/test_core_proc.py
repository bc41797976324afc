"""EngineCore process + client over ZMQ, with the echo engine (no model needed)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from server_utils import POISON_TOKEN, echo_request, make_echo_engine

from engine.config import EngineConfig
from engine.core.core_client import EngineCoreClient, EngineDeadError, EngineStartError
from engine.seam import EngineCoreOutputs, FinishReason

pytestmark = pytest.mark.timeout(60)


class Collector:
    """Gathers outputs per request; `done(rid)` resolves when rid finishes."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[int, str | None]] = {}
        self.stats: list[object] = []
        self.event = asyncio.Event()

    def __call__(self, outs: EngineCoreOutputs) -> None:
        if outs.stats is not None:
            self.stats.append(outs.stats)
        for o in outs.outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = (o.finish_reason, o.error)
        self.event.set()

    async def wait(self, *rids: str, timeout: float = 10.0) -> None:
        async def until() -> None:
            while not all(r in self.finish for r in rids):
                self.event.clear()
                await self.event.wait()

        await asyncio.wait_for(until(), timeout)


async def _start(multiprocess: bool, step_delay_ms: float = 0.0) -> tuple[EngineCoreClient, Collector]:
    cfg = EngineConfig()
    cfg.scheduler.step_delay_ms = step_delay_ms
    client = EngineCoreClient.start(
        cfg, multiprocess=multiprocess, engine_factory=make_echo_engine, ready_timeout_s=30,
    )
    col = Collector()
    client.on_outputs = col
    client.ensure_running()
    return client, col


@pytest.mark.parametrize("multiprocess", [True, False], ids=["process", "thread"])
def test_generate_abort_utility_and_step_error(multiprocess: bool) -> None:
    async def main() -> None:
        client, col = await _start(multiprocess, step_delay_ms=5)
        try:
            assert client.ready is not None and client.ready.max_model_len == 128
            client.add_request(echo_request("a", [1, 2, 3], max_tokens=5))
            client.add_request(echo_request("long", [7], max_tokens=10_000))
            await col.wait("a")
            assert col.tokens["a"] == [1, 2, 3, 1, 2]
            assert col.finish["a"] == (FinishReason.LENGTH, None)
            stats = await client.get_stats()
            assert stats.num_running == 1 and stats.kv_blocks_used > 0
            client.abort_requests(["long"])
            stats = await client.get_stats()
            assert stats.num_running == 0 and stats.kv_usage == 0.0
            assert col.stats and col.stats[-1].kv_blocks_total == 64
            with pytest.raises(RuntimeError, match="unknown utility"):
                await client.call_utility("__class__")
            # A step that raises fails the in-flight requests; the core keeps serving.
            client.add_request(echo_request("bad", [POISON_TOKEN], max_tokens=3))
            await col.wait("bad")
            reason, error = col.finish["bad"]
            assert reason == FinishReason.ERROR and error and "poisoned" in error
            client.add_request(echo_request("after", [4], max_tokens=2))
            await col.wait("after")
            assert col.tokens["after"] == [4, 4] and client.is_healthy()
        finally:
            client.shutdown()

    asyncio.run(main())


def test_killed_core_is_detected_at_once() -> None:
    async def main() -> None:
        client, col = await _start(True, step_delay_ms=20)
        dead: list[EngineDeadError] = []
        client.on_dead = dead.append
        try:
            client.add_request(echo_request("r", [1], max_tokens=10_000))
            await asyncio.sleep(0.1)
            assert client.pid is not None
            os.kill(client.pid, signal.SIGKILL)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while not dead and loop.time() - t0 < 2:
                await asyncio.sleep(0.01)
            assert dead and not client.is_healthy()
            assert loop.time() - t0 < 1.0
            with pytest.raises(EngineDeadError):
                client.add_request(echo_request("late", [1]))
        finally:
            client.shutdown()

    asyncio.run(main())


def _failing_factory(config: EngineConfig) -> object:
    raise ValueError("no such model 'nope'")


def test_start_failure_is_reported() -> None:
    async def main() -> None:
        with pytest.raises(EngineStartError, match="no such model"):
            EngineCoreClient.start(EngineConfig(), engine_factory=_failing_factory, ready_timeout_s=30)

    asyncio.run(main())


def test_ipc_folder_goes_with_the_client() -> None:
    """The sockets' folder is removed by shutdown(), and by the client's finalizer when it is
    dropped without one (no servelab-core-* folders left in the temp dir)."""
    import gc
    from pathlib import Path

    closed = EngineCoreClient(EngineConfig(), multiprocess=False)
    folder = Path(closed._tmpdir)
    assert folder.is_dir()
    closed.shutdown()
    assert not folder.exists()
    dropped = EngineCoreClient(EngineConfig(), multiprocess=False)
    folder = Path(dropped._tmpdir)
    del dropped
    gc.collect()
    assert not folder.exists()


def test_loop_and_front_end_time_are_accounted() -> None:
    """The core's loop splits its time into step / socket I/O / idle; the client counts output batches."""

    async def main() -> None:
        client, col = await _start(False, step_delay_ms=2)
        try:
            client.add_request(echo_request("a", [1, 2, 3], max_tokens=6))
            await col.wait("a")
            core = client._thread_core
            assert core is not None
            stats = core.loop_stats
            assert stats.steps >= 6  # one token per step
            assert stats.step_s >= stats.steps * 0.002  # the echo engine sleeps 2 ms a step
            assert stats.io_s > 0.0 and stats.idle_s >= 0.0
            assert f"{stats.steps} steps; step()" in stats.describe()
            assert client.output_batches >= 6 and client.output_s > 0.0
        finally:
            client.shutdown()

    asyncio.run(main())
