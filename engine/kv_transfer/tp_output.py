"""One report for the scheduler from every tensor-parallel rank's connector report.

Each rank's worker half loads and saves its own KV-head slice, on its own load thread, so the
ranks finish a request's load at different steps, and one may fail where another succeeds. The
scheduler may take a request's loaded blocks only when every rank has them (vLLM's
KVOutputAggregator): a request is reported in `finished_recving` (or `finished_sending`) once
all ranks have reported it, and in `failed_recving` when any of them failed it (the request then
recomputes those tokens on every rank). Blocks count once (each rank moved the same blocks);
bytes add up over the ranks; times are the slowest rank's.
"""

from __future__ import annotations

from collections import Counter

from engine.kv_transfer.metadata import KVConnectorOutput


class TPOutputMerger:
    """Kept by rank 0 across steps: `merge` takes every rank's report of one step, rank 0 first."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._recving: Counter[str] = Counter()
        self._sending: Counter[str] = Counter()
        self._failed: set[str] = set()

    def merge(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        first = outputs[0]
        out = KVConnectorOutput(num_blocks_loaded=first.num_blocks_loaded, num_blocks_saved=first.num_blocks_saved)
        for o in outputs:
            self._failed |= o.failed_recving
            self._recving.update(o.finished_recving)
            self._sending.update(o.finished_sending)
            for mine, theirs in ((out.bytes_loaded, o.bytes_loaded), (out.bytes_saved, o.bytes_saved)):
                for rid, n in theirs.items():
                    mine[rid] = mine.get(rid, 0) + n
            for rid, t in o.save_time.items():
                out.save_time[rid] = max(out.save_time.get(rid, 0.0), t)
            out.load_time = max(out.load_time, o.load_time)
            out.total_save_time = max(out.total_save_time, o.total_save_time)
        out.finished_recving = self._complete(self._recving)
        out.failed_recving = out.finished_recving & self._failed
        self._failed -= out.finished_recving
        out.finished_sending = self._complete(self._sending)
        return out

    def _complete(self, counts: Counter[str]) -> set[str]:
        done = {rid for rid, n in counts.items() if n >= self.world_size}
        for rid in done:
            del counts[rid]
        return done
