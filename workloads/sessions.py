"""Multi-turn sessions: dependent requests whose prompt contains the previous answer.

Turn k's prompt = turn k-1's prompt + turn k-1's answer + a new user message. The answer is
known only once turn k-1 has finished, so only turn 0 of each session is in the initial
workload; each spec carries a `follow_up` that the driver calls with the finished record and
that builds the next turn (sent `think_time_s` after the previous one finished). Request ids
are "<session>-t<k>" and `group` is the session id, so reports can follow a conversation.

Token-id sessions append the answer's token ids (the record's `output_token_ids`, else the
encoded `output_text`); text sessions append the answer text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from analysis.record import RequestRecord
from workloads.lengths import LengthDist
from workloads.prompts import PromptBuilder
from workloads.spec import RequestSpec


@dataclass(frozen=True, slots=True)
class SessionShape:
    num_turns: int
    first_prompt: LengthDist
    message: LengthDist  # tokens of each later user message
    output: LengthDist
    think_time_s: float = 0.0
    as_token_ids: bool = False


class _NextTurn:
    """follow_up callable of one session: builds turn k+1 from turn k and its record."""

    def __init__(self, builder: PromptBuilder, shape: SessionShape, seed: int) -> None:
        self.builder = builder
        self.shape = shape
        self.rng = np.random.default_rng(seed)

    def __call__(self, spec: RequestSpec, record: RequestRecord) -> RequestSpec | None:
        if spec.turn + 1 >= self.shape.num_turns or not record.ok:
            return None
        msg_len = int(self.shape.message.sample(1, self.rng)[0])
        max_tokens = int(self.shape.output.sample(1, self.rng)[0])
        offset = self.builder.random_offset(self.rng)
        if self.shape.as_token_ids:
            answer = record.output_token_ids
            if answer is None:
                answer = self.builder.encode(record.output_text)
            ids = list(spec.prompt_token_ids or []) + list(answer) + self.builder.token_ids(msg_len, offset)
            prompt, plen = None, len(ids)
        else:
            head = (spec.prompt or "") + record.output_text + "\n"
            prompt, token_ids = self.builder.text(len(self.builder.encode(head)) + msg_len, offset, head=head)
            ids, plen = None, len(token_ids)
        return replace(
            spec,
            request_id=f"{spec.session_id}-t{spec.turn + 1}",
            arrival_s=record.done_s + self.shape.think_time_s,
            prompt=prompt,
            prompt_token_ids=ids,
            prompt_len=plen,
            max_tokens=max_tokens,
            turn=spec.turn + 1,
            is_warmup=False,
        )


def session_workload(
    builder: PromptBuilder, starts: np.ndarray, shape: SessionShape, rng: np.random.Generator,
    id_prefix: str = "sess",
) -> list[RequestSpec]:
    """Turn 0 of one session per start time (starts: [num_sessions] seconds, sorted)."""
    n = len(starts)
    p_lens = shape.first_prompt.sample(n, rng)
    o_lens = shape.output.sample(n, rng)
    specs = []
    for i in range(n):
        sid = f"{id_prefix}-{i}"
        offset = builder.random_offset(rng)
        if shape.as_token_ids:
            prompt, ids = None, builder.token_ids(int(p_lens[i]), offset)
        else:
            prompt, ids = builder.text(int(p_lens[i]), offset)[0], None
        specs.append(
            RequestSpec(
                request_id=f"{sid}-t0",
                arrival_s=float(starts[i]),
                prompt=prompt,
                prompt_token_ids=ids,
                prompt_len=int(p_lens[i]),
                max_tokens=int(o_lens[i]),
                group=sid,
                session_id=sid,
                turn=0,
                follow_up=_NextTurn(builder, shape, seed=int(rng.integers(0, 2**31))),
            )
        )
    return specs
