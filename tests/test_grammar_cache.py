"""GrammarCache with a fake compiler (no model, no llguidance work): the LRU bound, the
per-compile deadline, and a compile thread written off and replaced when it overruns."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from engine.config import EngineConfig, StructuredOutputsConfig
from engine.structured_output.grammar_cache import CompileJob, GrammarCache
from engine.structured_output.params import StructuredOutputsParams, is_compile_busy, is_grammar_failure


def _regex(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"r{i}")


class FakeCompiler:
    """Returns a marker per spec; a spec in `stuck` blocks until `release` is set."""

    def __init__(self, stuck: tuple[str, ...] = ()) -> None:
        self.stuck, self.release = stuck, threading.Event()
        self.compiled: list[str] = []

    def __call__(self, tokenizer: Any, params: StructuredOutputsParams) -> Any:
        spec = params.key[1]
        if spec in self.stuck:
            assert self.release.wait(30), "the test never released a stuck compile"
        self.compiled.append(spec)
        return f"matcher<{spec}>"


def _settle(cache: GrammarCache, *jobs: CompileJob, limit_s: float = 10.0) -> None:
    """Drive the cache as the engine loop does (expire + wait) until every job is done."""
    deadline = time.monotonic() + limit_s
    while not all(j.done.is_set() for j in jobs):
        assert time.monotonic() < deadline, "jobs never settled"
        cache.expire()
        cache.wait(0.05)


@pytest.fixture
def compiler() -> Any:
    c = FakeCompiler(stuck=("slow",))
    yield c
    c.release.set()  # let a written-off thread end


def test_lru_evicts_past_its_bound_and_a_hit_refreshes_recency(compiler: FakeCompiler) -> None:
    cache = GrammarCache(lambda: "tok", compiler, capacity=2, timeout_s=5.0)
    a, b = cache.get(_regex(1)), cache.get(_regex(2))
    assert cache.get(_regex(1)) is a  # a hit: no new compile, and r1 is now the most recent
    c = cache.get(_regex(3))  # past the bound: the least recently used (r2) goes
    _settle(cache, a, b, c)
    assert _regex(1) in cache and _regex(3) in cache and _regex(2) not in cache and len(cache) == 2
    assert cache.num_compiles == 3 and a.matcher == "matcher<r1>"
    b2 = cache.get(_regex(2))  # evicted: compiled again
    _settle(cache, b2)
    assert b2 is not b and cache.num_compiles == 4 and _regex(1) not in cache
    cache.shutdown()


def test_an_overrunning_compile_fails_with_the_timeout_and_others_go_on(compiler: FakeCompiler) -> None:
    # One thread only: the spec queued behind the stuck one runs on the thread that replaces it.
    cache = GrammarCache(lambda: "tok", compiler, capacity=8, timeout_s=0.3, threads=1)
    slow = cache.get(StructuredOutputsParams(regex="slow"))
    fast = cache.get(_regex(1))
    t0 = time.monotonic()
    _settle(cache, slow, fast)
    assert time.monotonic() - t0 < 5.0  # ~0.3 s; the stuck compile is still running
    assert slow.matcher is None and slow.error is not None
    assert slow.error.startswith("guided_regex: grammar compile timed out after 0.3 s")
    assert "compile_timeout_s" in slow.error and is_grammar_failure(slow.error)
    assert fast.matcher == "matcher<r1>" and fast.error is None
    assert cache.num_timeouts == 1 and compiler.compiled == ["r1"]
    # The failure stays cached: asking again starts no second runaway compile.
    assert cache.get(StructuredOutputsParams(regex="slow")) is slow and cache.num_compiles == 2
    compiler.release.set()
    time.sleep(0.1)
    assert slow.matcher is None  # the late result of a written-off compile is dropped
    cache.shutdown()


def test_the_deadline_starts_after_the_tokenizer_load(compiler: FakeCompiler) -> None:
    def slow_tokenizer() -> str:
        time.sleep(0.5)  # longer than the timeout: the first compile still succeeds
        return "tok"

    cache = GrammarCache(slow_tokenizer, compiler, capacity=8, timeout_s=0.2)
    job = cache.get(_regex(1))
    _settle(cache, job)
    assert job.matcher == "matcher<r1>" and cache.num_timeouts == 0
    cache.shutdown()


def test_a_compile_error_names_the_field(compiler: FakeCompiler) -> None:
    def broken(tokenizer: Any, params: StructuredOutputsParams) -> Any:
        raise RuntimeError("lexer blew up\n  at state 3")

    cache = GrammarCache(lambda: "tok", broken, capacity=8, timeout_s=5.0)
    job = cache.get(_regex(1))
    _settle(cache, job)
    assert job.error == "guided_regex: lexer blew up at state 3"
    cache.shutdown()


def test_config_fields_and_their_checks() -> None:
    cfg = EngineConfig.from_kwargs(grammar_cache_size=4, compile_timeout_s=0.5)
    assert cfg.structured_outputs_config == StructuredOutputsConfig(grammar_cache_size=4, compile_timeout_s=0.5)
    assert EngineConfig().structured_outputs_config == StructuredOutputsConfig(128, 10.0)
    with pytest.raises(ValueError, match="grammar_cache_size"):
        EngineConfig.from_sections({"structured_outputs_config": {"grammar_cache_size": 0}})
    with pytest.raises(ValueError, match="compile_timeout_s"):
        EngineConfig.from_kwargs(compile_timeout_s=0)


def test_compiles_in_flight_are_capped_and_a_written_off_one_leaves_the_count_when_it_ends() -> None:
    """Issue 60 item 2, without a model: two stuck specs written off still count (their threads
    burn on), so with a cap of 3 a third new spec compiles, a fourth is refused at once (not
    cached) while a cached spec is still served; once the stuck compiles end, the count falls
    and the refused spec compiles when asked again. The written-off threads leave the books."""
    compiler = FakeCompiler(stuck=("s1", "s2"))
    cache = GrammarCache(lambda: "tok", compiler, capacity=8, timeout_s=0.2, max_in_flight=3)
    try:
        done = cache.get(_regex(0))
        _settle(cache, done)
        stuck = [cache.get(StructuredOutputsParams(regex=s)) for s in ("s1", "s2")]
        _settle(cache, *stuck)  # both timed out; their compiles still run
        assert cache.num_timeouts == 2 and cache.num_in_flight == 2
        third = cache.get(_regex(3))
        refused = cache.get(_regex(4))  # 3 in flight (2 written off, r3 queued or running)
        assert refused.done.is_set() and refused.matcher is None and refused.error is not None
        assert is_compile_busy(refused.error) and not is_grammar_failure(refused.error)
        assert "3 grammar compiles in flight" in refused.error and "max_compiles_in_flight" in refused.error
        assert _regex(4) not in cache and cache.num_refused == 1
        assert cache.get(_regex(0)) is done  # a cached spec is served at the cap
        _settle(cache, third)
        compiler.release.set()
        deadline = time.monotonic() + 10
        while cache.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cache.num_in_flight == 0 and not cache._written_off and len(cache._threads) == 2
        again = cache.get(_regex(4))
        _settle(cache, again)
        assert again.matcher == "matcher<r4>"
    finally:
        compiler.release.set()
        cache.shutdown()
    with pytest.raises(ValueError, match="max_compiles_in_flight"):
        EngineConfig.from_kwargs(max_compiles_in_flight=0)
