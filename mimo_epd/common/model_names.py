"""The model names every server accepts besides a checkpoint directory.

- `tiny` (the default): the small trained MiMo-V2-Flash checkpoint shipped in the package (`mimo_epd.data`,
  docs/model.md), with its MTP layers, tokenizer, chat template and tiny vision tower. It is an ordinary checkpoint
  directory: `resolve_model("tiny")` is its path, and everything loads it through the directory path.
- `tiny-random`: the seeded random-weights model of any shape the tests need (a byte tokenizer, no files).
"""

from __future__ import annotations

TINY = "tiny"
TINY_RANDOM = "tiny-random"


def resolve_model(name: str) -> str:
    """The checkpoint directory a model name stands for (`tiny` -> the shipped one); other names unchanged."""
    if name == TINY:
        from mimo_epd.data import TINY_MODEL

        return TINY_MODEL
    return name
