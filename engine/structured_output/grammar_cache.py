"""GrammarCache: compiled grammar templates by spec, an LRU of bounded size, each compile on a
background thread with a deadline.

Why compiles that overrun are written off rather than stopped: a compile cannot be
interrupted (llguidance runs it in native code with the GIL dropped). A compile still running
`compile_timeout_s` after it began is failed (its requests get an error naming the timeout)
and its thread is left to finish on its own, its result dropped; a fresh thread takes its
place, so one pathological spec holds no other compile back. The failure stays cached under
its spec, like any compile error, so asking again for that spec does not start another
runaway compile (until it is evicted). The deadline starts when the compile itself starts:
neither the wait for a free thread nor the one-time tokenizer load counts.

Why compiles in flight are capped. A written-off thread still burns a core until its compile
ends; N pathological specs would leave N of them. So every compile is counted from `get` until
its thread is done with it (queued, running, or written off and still running), and while
`max_in_flight` are, `get` refuses a spec that is not cached: its job fails at once with a
message starting `params.COMPILES_BUSY` (the HTTP layer answers 429) and is not cached, so the
spec compiles once asked again after the runaway compiles end. Cached specs are still served.

Threads: `compile_threads` healthy compile threads (`_threads`) take specs in arrival order; the engine
thread calls `get` (admission), `expire` and `wait` (each step). A job's result is written
once, under the cache's lock, before its `done` event is set; the engine thread never waits
on the (seconds-long) tokenizer load, which has a lock of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import llguidance as llg

from engine.structured_output.grammar import GrammarCompiler
from engine.structured_output.params import COMPILES_BUSY, StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # two specs compile at once: a slow one never stands alone before the rest


@dataclass(eq=False)
class CompileJob:
    """One spec's compile. Once `done` is set exactly one of `matcher` (the template) and
    `error` (one line; "<field>: why" when the spec is at fault) is filled."""

    params: StructuredOutputsParams
    done: threading.Event = field(default_factory=threading.Event)
    matcher: llg.LLMatcher | None = None
    error: str | None = None
    started: float | None = None  # time.monotonic() when the compile itself began


class GrammarCache:
    def __init__(
        self, make_tokenizer: Callable[[], llg.LLTokenizer], compiler: GrammarCompiler,
        capacity: int, timeout_s: float, threads: int = COMPILE_THREADS, max_in_flight: int = 8,
    ) -> None:  # fmt: skip
        """`make_tokenizer` runs once, on the first compile thread that needs it; `compiler`
        is read at each compile (tests swap it)."""
        self._make_tokenizer = make_tokenizer
        self.compiler = compiler
        self.capacity, self.timeout_s, self.max_in_flight = capacity, timeout_s, max_in_flight
        self._in_flight: set[CompileJob] = set()  # from `get` until a thread is done with it
        self._entries: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self._queue: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._tokenizer: llg.LLTokenizer | None = None
        self._running: dict[CompileJob, threading.Thread] = {}
        self._written_off: set[threading.Thread] = set()
        self._finished = threading.Event()  # some job finished since the last `wait`
        self._threads = [self._start_thread() for _ in range(threads)]
        self.num_compiles = 0  # compiles started (cache misses)
        self.num_timeouts = 0
        self.num_refused = 0  # specs refused while `max_in_flight` compiles were in flight

    # ---- engine thread -------------------------------------------------------------------
    def get(self, params: StructuredOutputsParams) -> CompileJob:
        """The job of `params`' spec: cached (now the most recently used), or a new compile
        queued; past `capacity`, the least recently used entry is dropped (a compile still
        running for it goes on for the requests that wait on it). With `max_in_flight`
        compiles in flight, a spec not cached gets a job already failed (not cached)."""
        key = params.key
        cached = self._entries.get(key)
        if cached is not None:
            self._entries.move_to_end(key)
            return cached
        job = CompileJob(params)
        with self._lock:
            busy, overrun = len(self._in_flight), len(self._written_off)
            if busy < self.max_in_flight:
                self._in_flight.add(job)
        if busy >= self.max_in_flight:
            return self._refused(params, busy, overrun)
        self._entries[key] = job
        self.num_compiles += 1
        self._queue.put(job)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return job

    @property
    def num_in_flight(self) -> int:
        """Compiles queued, running, or written off and still running."""
        with self._lock:
            return len(self._in_flight)

    def _refused(self, params: StructuredOutputsParams, busy: int, overrun: int) -> CompileJob:
        self.num_refused += 1
        job = CompileJob(params)
        job.error = (f"{COMPILES_BUSY}: {busy} grammar compiles in flight ({overrun} of them past "
                     f"compile_timeout_s and still running), the most structured_outputs_config."
                     f"max_compiles_in_flight allows; a new grammar ({params.field}) is refused until one "
                     "ends: retry later")  # fmt: skip
        job.done.set()
        return job

    def expire(self) -> None:
        """Fail every compile running past its deadline; its thread is written off and replaced
        (under the lock, so a compile that ends at that moment cannot take another job)."""
        now = time.monotonic()
        written_off = []
        with self._lock:
            late = [(job, thread) for job, thread in self._running.items()
                    if job.started is not None and now - job.started > self.timeout_s]  # fmt: skip
            for job, thread in late:
                del self._running[job]
                if job.done.is_set():
                    continue
                job.error = (f"{job.params.field}: grammar compile timed out after {self.timeout_s:g} s "
                             "(structured_outputs_config.compile_timeout_s)")  # fmt: skip
                job.done.set()
                self.num_timeouts += 1
                self._written_off.add(thread)
                self._threads.remove(thread)
                self._threads.append(self._start_thread())
                written_off.append((job.error, len(self._written_off), len(self._in_flight)))
        if written_off:
            self._finished.set()
        for error, overrunning, in_flight in written_off:
            logger.warning("%s; its compile thread is written off (%d still running, %d compiles in flight)",
                           error, overrunning, in_flight)  # fmt: skip

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until a compile finishes, or the earliest deadline passes."""
        with self._lock:
            starts = [job.started for job in self._running if job.started is not None]
        if starts:
            timeout_s = min(timeout_s, max(0.0, min(starts) + self.timeout_s - time.monotonic()) + 1e-3)
        self._finished.wait(timeout_s)
        self._finished.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, params: StructuredOutputsParams) -> bool:
        return params.key in self._entries

    def shutdown(self) -> None:
        with self._lock:
            healthy = len(self._threads)  # written-off threads never read the queue again
        for _ in range(healthy):
            self._queue.put(None)

    # ---- compile threads -----------------------------------------------------------------
    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name="grammar-compile", daemon=True)
        thread.start()
        return thread

    def _work(self) -> None:
        me = threading.current_thread()
        while (job := self._queue.get()) is not None:
            with self._lock:
                if job.done.is_set():
                    self._in_flight.discard(job)
                    continue
                self._running[job] = me
            matcher, error = None, None
            try:
                tokenizer = self._tokenizer_once()
                job.started = time.monotonic()
                matcher = self.compiler(tokenizer, job.params)
            except Exception as exc:  # the spec's fault (it names the field) or the tokenizer's
                error = _one_line(str(exc)) or type(exc).__name__
                if job.started is not None and not error.startswith(job.params.field + ":"):
                    error = f"{job.params.field}: {error}"
            self._finish(job, matcher, error, me)
            with self._lock:
                self._in_flight.discard(job)
                if me in self._written_off:  # a replacement took this thread's place while it overran
                    self._written_off.discard(me)
                    return

    def _tokenizer_once(self) -> llg.LLTokenizer:
        with self._tokenizer_lock:  # not `_lock`: the engine thread must not wait on a load
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def _finish(self, job: CompileJob, matcher: llg.LLMatcher | None, error: str | None,
                thread: threading.Thread) -> bool:  # fmt: skip
        """Settle `job` once (False: it was settled already, e.g. timed out first)."""
        with self._lock:
            if self._running.get(job) is thread:
                del self._running[job]
            if job.done.is_set():
                return False
            job.matcher, job.error = matcher, error
            job.done.set()
        self._finished.set()
        return True


def _one_line(msg: str) -> str:
    return " ".join(msg.split())[:300]
