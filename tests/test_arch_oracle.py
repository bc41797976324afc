"""The architectures beside Llama, token for token against HF transformers (issue 58 item 5).

Each family's checkpoint is written here: a tiny random model of HF transformers (2 layers,
hidden 64, vocabulary 256) saved with `save_pretrained` as safetensors, then served by
`LLM(model=<folder>, dtype="float32")` and its greedy tokens compared with HF's `generate` on the
same prompts. What each family adds to the Llama layer is made to matter: the random weights are
widened (HF's init gives near-uniform logits), and every norm weight and bias drawn away from
its initial 1 or 0, so a q/k norm or a bias the engine dropped would change the tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.frontend.llm import LLM
from engine.model import registry
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers", reason="HF transformers writes and runs the reference models")

MAX_TOKENS = 10
PROMPTS = [
    [1, 17, 99, 5, 42],
    [1, 200, 3, 3, 3, 3, 81, 250, 7, 64, 128, 9],
    [1, 255],
    [1, *range(30, 70)],  # 41 tokens: three KV blocks of 16
]
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rope_theta=1000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _config(family: str):
    if family == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**COMMON)
    if family == "qwen3":  # q/k RMSNorm per head; head_dim (32) is not hidden / heads (16)
        return transformers.Qwen3Config(head_dim=32, **COMMON)
    if family == "qwen3_moe":  # routed experts, norm_topk_prob as Qwen3-30B-A3B's config
        return transformers.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                           norm_topk_prob=True, **COMMON)  # fmt: skip
    if family == "qwen3_moe_unnormalized":  # HF's default: the top-k softmax weights as they are
        return transformers.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                           norm_topk_prob=False, **COMMON)  # fmt: skip
    assert family == "phi3"  # fused qkv_proj / gate_up_proj in the checkpoint
    return transformers.Phi3Config(**COMMON)


def _write_checkpoint(family: str, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:  # norm weights
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    hf.eval().save_pretrained(folder)
    return hf


def _hf_greedy(hf: torch.nn.Module) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in PROMPTS:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=2)  # fmt: skip
            outs.append(y[0, len(ids):].tolist())
    return outs


FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "qwen3_moe_unnormalized", "phi3"]
EXPECTED_FAMILY = {"qwen3_moe_unnormalized": "qwen3_moe"}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf(family: str, tmp_path: Path) -> None:
    hf = _write_checkpoint(family, tmp_path)
    expected = _hf_greedy(hf)
    llm = LLM(model=str(tmp_path), dtype="float32", max_num_seqs=4, num_blocks=64, block_size=16)
    model = llm.engine_core.executor.worker.model  # type: ignore[attr-defined]  # (the in-process executor's)
    assert model.arch.family == EXPECTED_FAMILY.get(family, family) and model.arch.num_layers == 2
    assert type(model).__name__ == registry.family(model.arch.family).class_name
    # no GGUF file: nothing reaches the block kernels; a layer with a family switch has no plan
    assert model.gguf_path is None and model.block_lm_head is None
    assert not any("gguf_blocks" in m.__dict__ for m in model.modules())
    if family != "phi3":
        assert model.model.plan is None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    one_by_one = [llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids for ids in PROMPTS]
    assert together == expected
    assert one_by_one == expected
    # the continuations are not one token repeated: the comparison says something
    assert sum(len(set(t)) for t in expected) > 2 * len(expected)
