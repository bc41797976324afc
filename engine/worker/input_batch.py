"""The model runner's persistent batch.

Each request the runner knows owns one row of preallocated host arrays (its token
ids, its block table, its counters) from its first step until the scheduler lists
it as finished or preempted. A step only sends deltas (new block ids, counts), so
per-step work is proportional to the tokens scheduled, not to the sequence lengths.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from engine.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, num_other_groups: int = 0) -> None:
        """`num_other_groups`: KV cache groups past the first (engine/kv_cache_spec.py), each with a
        block table of its own (`group_tables`)."""
        self.max_model_len = max_model_len
        # +1: a request may hold max_model_len tokens plus nothing more; keep one spare column.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # tokens known (prompt + sampled)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)  # tokens whose KV is in the cache
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.group_tables = [np.zeros_like(self.block_table) for _ in range(num_other_groups)]
        self.group_num_blocks = [np.zeros_like(self.num_blocks) for _ in range(num_other_groups)]
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        # a min-heap: a new request takes the lowest free row, so requests that run together sit in
        # the first rows (a decode step of rows 0 .. r - 1 takes the runner's persistent inputs)
        self._free_rows = list(range(max_num_reqs))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        block_ids: list[int],
        num_computed: int,
        group_block_ids: list[list[int]] | None = None,
    ) -> int:
        if req_id in self.row_of:
            self.remove(req_id)
        if not self._free_rows:
            raise RuntimeError("persistent batch is full: more running requests than max_num_seqs")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"request {req_id}: {len(token_ids)} tokens exceed max_model_len {self.max_model_len}")
        row = heapq.heappop(self._free_rows)
        self.row_of[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        for g, ids in enumerate(group_block_ids or ()):
            self.group_num_blocks[g][row] = 0
            self.append_group_blocks(row, g, ids)
        self.params[row] = params
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator().manual_seed(params.seed)
        self.generators[row] = gen
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.generators[row] = None
        heapq.heappush(self._free_rows, row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError(f"block table row overflow: {end} blocks > {self.block_table.shape[1]}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_group_blocks(self, row: int, group: int, block_ids: list[int]) -> None:
        """Blocks appended to the request's table in group `group + 1` (the first past group 0)."""
        if not block_ids:
            return
        start = int(self.group_num_blocks[group][row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError(f"block table row overflow: {end} blocks > {self.block_table.shape[1]}")
        self.group_tables[group][row, start:end] = block_ids
        self.group_num_blocks[group][row] = end

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def prompt_ids(self, row: int) -> list[int]:
        return self.token_ids[row, : self.num_prompt_tokens[row]].tolist()

    def output_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()
