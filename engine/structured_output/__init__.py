"""Structured output: grammar-constrained sampling (JSON schema, regex, choice, Lark grammar).

`params.py` is what a request asks for; `grammar.py` turns it into an llguidance grammar
and matcher; `manager.py` (in the EngineCore) compiles grammars off the engine loop, fills
one token bitmask per constrained request each step and advances the grammars with the
accepted tokens. The model runner applies the bitmask to the logits before sampling
(`engine/sample/logits_mask.py`).
"""
