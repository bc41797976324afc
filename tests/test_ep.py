"""MoE expert parallelism (issue 14): dispatch / combine over gloo, and EP=2 against one rank.

- `test_dispatch_reaches_exactly_the_expert_ranks`: two gloo processes route tokens with
  random top-k; every token's hidden state reaches exactly the ranks holding one of its
  experts, once each, with its expert ids mapped to local ones (-1 elsewhere), and combine
  brings each (token, rank) row back once.
- `test_expert_parallel_matches_one_rank`: a tiny Mixtral-shaped model with dummy weights
  (2 layers, 4 experts, top-2) gives the same greedy tokens and top-20 logprobs (fp32, tight
  tolerance) with tensor_parallel_size=2 + enable_expert_parallel as on one rank. The dispatch
  test's ranks also check the tensor-parallel MoE block (experts sliced, no EP) against one rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from engine.distributed.moe_dispatch import AllToAllDispatcher
from engine.executor.multiproc import free_port

TINY_MIXTRAL = {
    "model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 512,
    "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1,
}
E, K, T, H = 4, 2, 7, 8


def _dispatch_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # [T, K] distinct experts
        token_ids = torch.arange(T, dtype=torch.float32) + 1000 * rank  # globally unique ids
        x = torch.randn(T, H, generator=gen)
        x[:, 0] = token_ids
        weights = torch.rand(T, K, generator=gen)
        d = AllToAllDispatcher(E, world, rank)
        layout = d.get_dispatch_layout(topk, E)
        recv = d.dispatch(x, topk, weights, layout)
        back = d.combine(recv.x, recv.handle)  # identity experts: each rank returns what it got
        torch.save({"topk": topk, "x": x, "weights": weights, "recv_x": recv.x, "recv_idx": recv.topk_idx,
                    "recv_w": recv.topk_weights, "back": back, "per_rank": layout.num_tokens_per_rank,
                    "tp_moe_error": _tp_moe_error(rank, world)}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _tp_moe_error(rank: int, world: int) -> float:
    """Max |difference| between one rank's MoEBlock and the tensor-parallel TPMoEBlock (each
    expert's intermediate rows sliced, outputs all-reduced) on the same tokens."""
    from engine.distributed import parallel_state as ps
    from engine.distributed.sharding import _rows, split_range
    from engine.model.moe import MoEBlock
    from engine.model.parallel_layers import TPMoEBlock

    ps.init_distributed(rank, world)  # the group exists: only records the rank
    torch.manual_seed(0)  # same weights and tokens on both ranks
    hidden, inter = 16, 12
    full = MoEBlock(hidden, inter, E, K)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.2)
    start, count = split_range(inter, world, rank)
    part = TPMoEBlock(hidden, count, E, K)
    with torch.no_grad():
        part.gate.weight.copy_(full.gate.weight)
        part.w13.copy_(_rows(full.w13, 1, (start, count), (inter + start, count)))
        part.w2.copy_(full.w2.narrow(2, start, count))
        x = torch.randn(9, hidden)
        return float((part(x) - full(x)).abs().max())


def test_dispatch_reaches_exactly_the_expert_ranks(tmp_path: Path) -> None:
    world = 2
    mp.spawn(_dispatch_rank, args=(world, free_port("127.0.0.1"), str(tmp_path)), nprocs=world)
    data = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    experts_of_rank = {0: {0, 1}, 1: {2, 3}}  # split_range(4, 2, r)
    sent: dict[int, list[int]] = {r: [] for r in range(world)}
    for src in range(world):
        d = data[src]
        for t in range(T):
            chosen = set(d["topk"][t].tolist())
            owners = sorted(r for r in range(world) if chosen & experts_of_rank[r])
            for r in owners:
                sent[r].append(1000 * src + t)
            # combine: the row came back once from each owner rank, nothing else
            assert torch.allclose(d["back"][t], d["x"][t] * len(owners))
    assert all(d["tp_moe_error"] < 1e-5 for d in data)  # tensor-parallel MoE (no EP) equals one rank
    for r in range(world):
        got = data[r]["recv_x"][:, 0].long().tolist()
        assert sorted(got) == sorted(sent[r])  # exactly the tokens with an expert here, once each
        for row, tok in enumerate(got):
            src, t = divmod(tok, 1000)
            topk, w = data[src]["topk"][t], data[src]["weights"][t]
            first = min(experts_of_rank[r])
            expected = [e - first if e in experts_of_rank[r] else -1 for e in topk.tolist()]
            assert data[r]["recv_idx"][row].tolist() == expected
            assert torch.equal(data[r]["recv_w"][row], w)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("shapes") / "tiny-mixtral.yaml"
    path.write_text(yaml.safe_dump(TINY_MIXTRAL))
    return str(path)


def _logprob_run(model: str, **parallel: object) -> tuple[list[list[int]], list[list]]:
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=model, dtype="float32", num_blocks=32, block_size=8, max_num_seqs=4, max_model_len=128,
              max_num_batched_tokens=16, **parallel)
    try:
        prompts = [[1, 5, 9, 33, 200, 17, 4, 99, 120, 7, 3], [1, 400, 401, 402], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=20)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        steps = llm.step_stats
    finally:
        llm.engine_core.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    if parallel.get("enable_expert_parallel"):
        assert sum(s.dispatch_time for s in steps) > 0 and sum(s.combine_time for s in steps) > 0
    return tokens, logprobs


def _assert_same_logprobs(a: list, b: list) -> None:
    assert len(a) == 3 and all(len(req) == 6 for req in a)
    for req_a, req_b in zip(a, b, strict=True):
        for pos_a, pos_b in zip(req_a, req_b, strict=True):
            ta, tb = dict(pos_a[2]), dict(pos_b[2])
            assert pos_a[0] == pos_b[0]
            assert abs(pos_a[1] - pos_b[1]) < 1e-4
            shared = ta.keys() & tb.keys()
            assert len(shared) >= 18  # ties at the tail may reorder
            for tok in shared:
                assert abs(ta[tok] - tb[tok]) < 1e-4, (tok, ta[tok], tb[tok])


def test_expert_parallel_matches_one_rank(tiny_mixtral: str) -> None:
    ref_tokens, ref_lp = _logprob_run(tiny_mixtral)
    ep_tokens, ep_lp = _logprob_run(tiny_mixtral, tensor_parallel_size=2, enable_expert_parallel=True)
    assert ep_tokens == ref_tokens
    _assert_same_logprobs(ep_lp, ref_lp)


# ---- the simulator names TP and EP -----------------------------------------------------------------
def test_roofline_prices_expert_parallel_all_to_all() -> None:
    from engine.sim.hardware import HardwareProfile
    from engine.sim.model_counts import load_arch
    from engine.sim.roofline import RooflineStepModel
    from engine.sim.step_batch import StepBatch

    arch, hw = load_arch("mixtral-8x7b"), HardwareProfile.load("h200")
    batch = StepBatch(num_tokens=256, num_sampled=256, attn_pairs=256 * 512, kv_tokens_read=256 * 512)
    tp_only = RooflineStepModel(arch, hw, tp=8)
    ep = RooflineStepModel(arch, hw, tp=8, ep=True)
    parts = ep.breakdown(batch)
    assert "all_to_all" not in tp_only.breakdown(batch) and parts["all_to_all"] > 0
    assert ep.step_time(batch) == pytest.approx(sum(parts.values()))
    with pytest.raises(ValueError, match="ep: model 'llama-3-8b' has no experts"):
        RooflineStepModel(load_arch("llama-3-8b"), hw, tp=8, ep=True)


def test_simulator_takes_the_engine_parallel_settings() -> None:
    from conf.schema import RunConfig

    cfg = RunConfig()
    cfg.parallel.tensor_parallel_size, cfg.parallel.enable_expert_parallel = 8, True
    assert cfg.sim_parallel() == (8, True)
    cfg.sim.tp = 4
    with pytest.raises(ValueError, match="sim.tp=4 and parallel.tensor_parallel_size=8 disagree"):
        cfg.sim_parallel()
