"""Text out of a token stream: an incremental detokenizer and a stop-string matcher.

Decoding each token alone is wrong twice over: a multi-byte UTF-8 character split across byte tokens
decodes to replacement characters, and tokenizers whose decoders depend on neighbours (SentencePiece's
leading-space marker, byte-level BPE merges) lose word boundaries. `IncrementalDetokenizer` decodes a
short window of ids instead: `prefix_offset..read_offset` is text already emitted, `prefix_offset..end`
the same window plus the new ids; only the difference is emitted, and nothing is emitted while the
window's text ends in an incomplete character (U+FFFD), so the bytes that finish it come out together.
Concatenating every delta and `flush()` equals `decode(all ids)` for the byte and byte-level tokenizers.

`StopMatcher` honours stop strings across token boundaries: it holds back the longest tail of the text
that is a prefix of some stop string, and on a match returns the text before it (the stop string itself
is not part of the output, as in the OpenAI API).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# Prompt ids kept as left context, so the first output token decodes with its word boundary.
CONTEXT_IDS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int] | tuple[int, ...] = (), vocab_size: int | None = None):
        self.decode = tokenizer.decode
        ctx = [t for t in prompt_ids if vocab_size is None or t < vocab_size][-CONTEXT_IDS:]
        if ctx and self.decode(ctx).endswith(REPLACEMENT):  # an incomplete character would swallow output bytes
            ctx = []
        self.ids: list[int] = list(ctx)
        self.prefix_offset = 0
        self.read_offset = len(ctx)

    def push(self, token_id: int) -> str:
        """Adds one id; returns the newly stable text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.buffer = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Feeds text; returns (text safe to emit, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        self.buffer += text
        buf = self.buffer
        first = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.matched = first[1]
            self.buffer = ""
            return buf[: first[0]], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        out, self.buffer = buf[: len(buf) - hold], buf[len(buf) - hold :]
        return out, False

    def flush(self) -> str:
        """The held-back tail once the stream ends without a match."""
        out, self.buffer = self.buffer, ""
        return out if self.matched is None else ""
