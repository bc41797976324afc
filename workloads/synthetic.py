"""Synthetic workloads: arrival times x length distributions x exact-length prompts.

Shared-prefix groups: `num_groups` system prompts of `prefix_len` tokens; a fraction
`fraction` of the requests (chosen at random, seeded) start with one of them (chosen
uniformly). Such a request's prompt is its group's prefix plus its own corpus text, `prompt_len`
tokens in all (at least prefix_len + 1). Its `group` is "prefix-<g>".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workloads.lengths import LengthDist
from workloads.prompts import PromptBuilder
from workloads.spec import RequestSpec


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    num_groups: int
    prefix_len: int
    fraction: float = 1.0


def synthetic_workload(
    builder: PromptBuilder,
    arrivals: np.ndarray,
    prompt_lens: LengthDist,
    output_lens: LengthDist,
    rng: np.random.Generator,
    *,
    as_token_ids: bool = False,
    shared_prefix: SharedPrefix | None = None,
    id_prefix: str = "req",
) -> list[RequestSpec]:
    """One spec per arrival time (arrivals: [n] seconds since run start, sorted).

    `as_token_ids=True` sends token ids (exact by construction, no text); otherwise text
    whose tokenization has exactly the sampled length.
    """
    n = len(arrivals)
    p_lens = prompt_lens.sample(n, rng)
    o_lens = output_lens.sample(n, rng)
    groups = _assign_groups(n, shared_prefix, rng)
    prefixes = _build_prefixes(builder, shared_prefix, as_token_ids)
    specs = []
    for i in range(n):
        g = int(groups[i])
        head = prefixes[g] if g >= 0 else None
        plen = int(p_lens[i]) if head is None else max(int(p_lens[i]), shared_prefix.prefix_len + 1)
        prompt, ids = _prompt(builder, plen, builder.random_offset(rng), head, as_token_ids)
        specs.append(
            RequestSpec(
                request_id=f"{id_prefix}-{i}",
                arrival_s=float(arrivals[i]),
                prompt=prompt,
                prompt_token_ids=ids,
                prompt_len=plen,
                max_tokens=int(o_lens[i]),
                group=f"prefix-{g}" if g >= 0 else "",
            )
        )
    return specs


def _assign_groups(n: int, sp: SharedPrefix | None, rng: np.random.Generator) -> np.ndarray:
    # [n] group index per request, -1 = no shared prefix
    if sp is None or sp.num_groups <= 0:
        return np.full(n, -1)
    members = rng.random(n) < sp.fraction
    which = rng.integers(0, sp.num_groups, size=n)
    return np.where(members, which, -1)


def _build_prefixes(
    builder: PromptBuilder, sp: SharedPrefix | None, as_ids: bool
) -> list[str | list[int]]:
    if sp is None:
        return []
    stride = max(1, len(builder.corpus_ids) // max(sp.num_groups, 1))
    out: list[str | list[int]] = []
    for g in range(sp.num_groups):
        if as_ids:
            out.append(builder.token_ids(sp.prefix_len, g * stride))
        else:
            out.append(builder.text(sp.prefix_len, g * stride)[0])
    return out


def _prompt(
    builder: PromptBuilder, n: int, offset: int, head: str | list[int] | None, as_ids: bool
) -> tuple[str | None, list[int] | None]:
    if as_ids:
        prefix = list(head) if isinstance(head, list) else []
        return None, prefix + builder.token_ids(n - len(prefix), offset)
    text, _ = builder.text(n, offset, head=head if isinstance(head, str) else "")
    return text, None
