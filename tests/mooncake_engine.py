"""A second engine process for the Mooncake tests (run by tests/test_kv_mooncake.py).

    python tests/mooncake_engine.py produce MASTER METADATA PROMPTS_JSON
        runs each prompt greedily with kv_role=kv_producer, prints {"tokens": [...]} as one JSON
        line, then keeps its store client (which holds the objects) until stdin closes.
    python tests/mooncake_engine.py fault MASTER METADATA MASTER_PID
        runs requests through a kv_both engine, stops the master mid-run (between a step that
        plans a load and its execution, and with requests still running), prints {"ok": ...}.

Both leave with os._exit: closing a Mooncake client whose master is gone waits on its timeouts.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.seam import (
    EngineCoreRequest,
    finish_reason_str,  # noqa: E402
)


def make_core(master: str, metadata: str, role: str, real: bool, num_blocks: int = 32) -> EngineCore:
    args: dict[str, object] = dict(block_size=16, num_blocks=num_blocks, max_num_seqs=4)
    # Real weights of the first 8 layers (tokens and KV bytes are compared), else 2 dummy layers.
    args.update(num_layers_override=8) if real else args.update(load_format="dummy", num_layers_override=2)
    extra = {"master_server_address": master, "metadata_server": metadata, "retry_after_s": 60,
             "global_segment_size": 64 << 20, "local_buffer_size": 32 << 20}  # fmt: skip
    args["kv_transfer_config"] = {"kv_connector": "MooncakeStoreConnector", "kv_role": role,
                                  "kv_connector_extra_config": extra}  # fmt: skip
    return EngineCore(EngineConfig.from_kwargs(model="smollm2", **args))


def kv_digest(core: EngineCore, prompt: list[int]) -> str:
    """sha256 of the device KV of the prompt's cached full blocks (all layers), to compare engines."""
    from engine.request import Request

    probe = Request("probe", prompt, greedy(1), None)
    probe.set_block_hasher(core.scheduler._block_hasher)  # type: ignore[arg-type]
    blocks, _ = core.scheduler.kv_cache_manager.get_computed_blocks(probe)
    ids = [b.block_id for b in blocks.blocks]
    kv = torch.stack([layer[:, ids] for layer in core.executor.worker.model_runner.kv_caches])  # type: ignore[attr-defined]
    return hashlib.sha256(kv.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() + f"/{len(ids)}"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def produce(master: str, metadata: str, prompts: list[list[int]]) -> None:
    core = make_core(master, metadata, "kv_producer", real=True)
    tokens = []
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"p{i}", p, greedy(6), None, 0.0, 6))
        got: list[int] = []
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                got += out.new_token_ids
        tokens.append(got)
    digests = [kv_digest(core, p) for p in prompts]
    print(json.dumps({"tokens": tokens, "kv_digests": digests}), flush=True)
    sys.stdin.read()  # the objects live in this client's segment until the test is done
    os._exit(0)


def fault(master: str, metadata: str, master_pid: int) -> None:
    core = make_core(master, metadata, "kv_both", real=False)
    sched = core.scheduler
    shared = [(i * 31 + 7) % 30000 + 100 for i in range(48)]
    for i in range(3):  # fill the store
        core.add_request(EngineCoreRequest(f"warm{i}", shared + [1000 + i] * 5, greedy(4), None, 0.0, 4))
    core.run_until_idle(max_steps=100)
    assert sched.reset_prefix_cache()
    # Long-running requests, and one whose prefix the store holds.
    for i in range(2):
        core.add_request(EngineCoreRequest(f"long{i}", [2000 + i] * 20, greedy(20), None, 0.0, 20))
    core.add_request(EngineCoreRequest("hit", shared + [3000] * 5, greedy(4), None, 0.0, 4))
    so = sched.schedule()
    planned = sum(len(t) for t in so.kv_connector_metadata.loads) if so.kv_connector_metadata else 0
    os.kill(master_pid, signal.SIGKILL)  # the master dies with a load planned and requests running
    sched.update_from_output(so, core.executor.execute_model(so))
    finished: dict[str, str | None] = {}
    steps = 0
    while core.has_unfinished_requests() and steps < 200:
        for out in core.step().outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = finish_reason_str(out.finish_reason)
        steps += 1
    remote = sched.remote_kv
    assert remote is not None
    idle = True
    try:
        sched.assert_idle()
    except AssertionError as exc:
        idle = f"{exc}"  # type: ignore[assignment]
    print(json.dumps({"planned_blocks": planned, "load_failures": remote.total_load_failures, "steps": steps,
                      "finished": finished, "idle": idle}), flush=True)  # fmt: skip
    os._exit(0)


if __name__ == "__main__":
    mode, master, metadata = sys.argv[1:4]
    if mode == "produce":
        produce(master, metadata, json.loads(sys.argv[4]))
    else:
        fault(master, metadata, int(sys.argv[4]))
