"""Reasoning content: the `<think>...</think>` block of a completion moved into `reasoning_content`.

MiMo's chat template (and the shipped model's) ends the generation prompt with `<think>\\n` when thinking is on,
so the completion starts inside the block: `REASONING\\n</think>\\n\\nCONTENT`. With thinking off the prompt closes
an empty block itself and the completion is content, unless the model opens `<think>` on its own (then that
block is reasoning too). Anything inside the block, a tool call included, is reasoning, never a tool call.

The split of a whole text (`split`): reasoning is the text before the first `</think>` without its surrounding
newlines, content the text after it without its leading newlines (the template renders a turn as
`<think>\\n` + reasoning + `\\n</think>\\n\\n` + content). A completion cut inside the block is all reasoning.

Streaming (`ReasoningStream`): after each delta the split of the text so far is computed with the parts that a
later delta could still change held back (trailing newlines and a partial `</think>` of the reasoning, leading
newlines of the content, a text that may still become `<think>`). Each held-back split is a prefix of every later
one, so the emitted deltas concatenate to exactly `split(full text)`.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split(text: str, thinking: bool, final: bool = True) -> tuple[str, str]:
    """(reasoning, content) of `text`; `final` False holds back what a continuation could change."""
    if not thinking:
        head = text.lstrip()
        if head.startswith(THINK_START):
            return split(head[len(THINK_START) :], True, final)
        if not final and THINK_START.startswith(head):
            return "", ""  # may still open a block
        return "", text
    end = text.find(THINK_END)
    if end < 0:
        if final:
            return text.strip("\n"), ""
        body = text[: len(text) - _partial_suffix(text, THINK_END)]
        return body.strip("\n"), ""
    return text[:end].strip("\n"), text[end + len(THINK_END) :].lstrip("\n")


class ReasoningStream:
    """Incremental `split`: `push(delta)` and `flush()` return (reasoning delta, content delta)."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self.text = ""
        self.sent = ["", ""]

    def _emit(self, parts: tuple[str, str]) -> tuple[str, str]:
        out = []
        for k in (0, 1):
            new = parts[k]
            assert new.startswith(self.sent[k]), "a held-back split is a prefix of the later ones"
            out.append(new[len(self.sent[k]) :])
            self.sent[k] = new
        return out[0], out[1]

    def push(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(split(self.text, self.thinking, final=False))

    def flush(self) -> tuple[str, str]:
        return self._emit(split(self.text, self.thinking, final=True))
