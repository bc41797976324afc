"""Speculative decoding: n-gram proposals verified by one forward of the target model.

`proposer.py` proposes draft tokens from a request's own tokens (prompt lookup);
`verify.py` turns the target model's logits at the draft positions into accepted tokens
(greedy: accept while equal; sampled: rejection sampling, which keeps the output
distribution exactly the target's). The scheduler budgets the drafts
(`Request.spec_token_ids`, `num_tokens_with_spec`) and rolls back the KV of rejected
ones (`Scheduler.update_from_output`).
"""
