"""MiMo-V2.5's omni prompt: where a request's media rows go and which tokens frame them (torch-free, so the worker
and the router's front share it).

A MiMo-V2.5 checkpoint names its media tokens in `config.json`'s `processor_config` (`image_token_id`,
`video_token_id`, `audio_token_id`, `vision_start_token_id`, `vision_end_token_id`, `audio_start_token_id`,
`audio_end_token_id`, `video_start_token_id`, `video_end_token_id`); `OmniTokens.from_config` reads them, and a
checkpoint without them keeps the plain layout (every item's rows right after the prompt's first token).

The layout is MiMo's own processor's (vLLM's `MiMoVLProcessor`, the facts in docs/model.md):

- The chat template renders each media part as a placeholder string (`PLACEHOLDER`: `<|vision_start|><|image_pad|>
  <|vision_end|>`, the same with `<|video_pad|>`, `<|mimo_audio_start|><|audio_pad|><|mimo_audio_end|>`; one or
  more pads). The rendered text is split at the placeholders (`split_text`), each text piece is tokenized on its
  own, and each placeholder is replaced, in order, by the next media item's ids:
  - image: `vision_start`, one id per embedding row, `vision_end`;
  - audio: `audio_start`, one id per row, `audio_end`;
  - video: `video_start`, then for each temporal group (two frames) the group's start time as `MM:SS` text
    (tokenized on its own), `vision_start`, the group's rows, `vision_end`; then `video_end`;
  - a video with its soundtrack (`use_audio_in_video`: the soundtrack's placeholder, right after the video's, takes
    nothing of its own): each group's vision part is followed by `audio_start`, the soundtrack's rows for the group's
    span, `audio_end` (`video_with_track`).
- A text with no placeholder at all takes the items at its front, after its first token (a template that does not
  render media parts, or a raw prompt); a text whose placeholders do not match the items one for one, kind for
  kind, is refused (`LayoutError`), never guessed at: a user's message that types a placeholder cannot take
  another part's media.

The rows' ids are the engine's placeholder ids (derived from each item's content key, >= the vocabulary size), not
the pad token: the embedding rows replace them either way, and equal media then give equal prefixes in the prefix
cache (and different media never do). Map each id >= the vocabulary back to its kind's pad id and the prompt is the
reference processor's, id for id (tests/reference checks exactly that).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PLACEHOLDER = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
    "audio": "<|mimo_audio_start|><|audio_pad|><|mimo_audio_end|>",
}
_PATTERNS = {
    "image": r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>",
    "video": r"<\|vision_start\|>(?:<\|video_pad\|>)+<\|vision_end\|>",
    "audio": r"<\|mimo_audio_start\|>(?:<\|audio_pad\|>)+<\|mimo_audio_end\|>",
}
AUDIO_ROWS_PER_SECOND = 25.0 / 4  # MiMo's audio: 25 code frames a second, 4 to an embedding row
MEDIA_RE = re.compile("|".join(f"(?P<{k}>{p})" for k, p in _PATTERNS.items()))
TOKEN_KEYS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
    "video_start_token_id",
    "video_end_token_id",
)


class LayoutError(ValueError):
    """The prompt's placeholders and the request's media items do not match."""


@dataclass(frozen=True)
class OmniTokens:
    """The media token ids of a MiMo-V2.5 checkpoint (`processor_config`)."""

    image_pad: int
    video_pad: int
    audio_pad: int
    vision_start: int
    vision_end: int
    audio_start: int
    audio_end: int
    video_start: int
    video_end: int

    @classmethod
    def from_config(cls, cfg: dict) -> OmniTokens | None:
        """The tokens of a `config.json` dict (its `processor_config`, where vLLM's processor reads them; a key it
        lacks from the config's top level, where a release may also write them); None where the processor_config
        names none; ValueError naming a key that is missing or not a token id where it names some."""
        pc = cfg.get("processor_config") if isinstance(cfg, dict) else None
        if not isinstance(pc, dict) or not any(k in pc for k in TOKEN_KEYS):
            return None
        vals = []
        for k in TOKEN_KEYS:
            v = pc[k] if k in pc else cfg.get(k)  # a key the processor_config lacks, from the config's top level
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"config.json processor_config.{k}: expected a token id, got {v!r}")
            vals.append(v)
        return cls(*vals)

    @classmethod
    def from_model(cls, model: str) -> OmniTokens | None:
        """The tokens of a checkpoint directory (None for a named model or a config without them)."""
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as fh:
            return cls.from_config(json.load(fh))

    def pad(self, kind: str) -> int:
        return {"image": self.image_pad, "video": self.video_pad, "audio": self.audio_pad}[kind]


@dataclass(frozen=True)
class ItemRows:
    """One media item as the encoder returned it: `kind`, one placeholder id per embedding row (`ids`) and, for a
    video, the start second and row count of each temporal group (`groups`, in order; rows sum to len(ids))."""

    kind: str
    ids: Sequence[int]
    groups: Sequence[tuple[float, int]] = field(default_factory=tuple)
    in_video: bool = False  # an audio item that is the previous video's soundtrack (use_audio_in_video)
    end_s: float = 0.0  # a video: where its sampled span ends (its soundtrack's rows run to it)


def timestamp(seconds: float) -> str:
    """A video group's time as the prompt writes it: minutes and seconds, `MM:SS` (minutes past 99 keep counting),
    of the time as a float32 (MiMo's processor holds frame times in float32 tensors)."""
    seconds = f32(seconds)
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def f32(x: float) -> float:
    """`x` rounded to float32 and back."""
    return struct.unpack("f", struct.pack("f", x))[0]


def split_text(text: str) -> list[tuple[str, str]]:
    """The text as (kind, piece) pairs in order: kind "" for text, else the placeholder's media kind."""
    out: list[tuple[str, str]] = []
    at = 0
    for m in MEDIA_RE.finditer(text):
        if m.start() > at:
            out.append(("", text[at : m.start()]))
        out.append((m.lastgroup or "", m.group()))
        at = m.end()
    if at < len(text):
        out.append(("", text[at:]))
    return out


def first_media_at(text: str) -> int:
    """Where the first placeholder starts in `text` (-1 for none): the text before it tokenizes the same in the
    worker's prompt, so the router can predict that much of a media request's prefix."""
    m = MEDIA_RE.search(text)
    return m.start() if m else -1


def item_ids(tokens: OmniTokens, item: ItemRows, encode: Callable[[str], list[int]]) -> list[int]:
    """The ids that replace one placeholder (the module docstring's rules)."""
    if item.kind == "image":
        return [tokens.vision_start, *item.ids, tokens.vision_end]
    if item.kind == "audio":
        return [tokens.audio_start, *item.ids, tokens.audio_end]
    if item.kind != "video":
        raise LayoutError(f"unknown media kind {item.kind!r}")
    if sum(n for _, n in item.groups) != len(item.ids):
        raise LayoutError(f"a video's groups hold {sum(n for _, n in item.groups)} rows, its embedding {len(item.ids)}")
    out, at = [tokens.video_start], 0
    for start, n in item.groups:
        out += encode(timestamp(start))
        out += [tokens.vision_start, *item.ids[at : at + n], tokens.vision_end]
        at += n
    out.append(tokens.video_end)
    return out


def video_with_track(
    tokens: OmniTokens, video: ItemRows, track: ItemRows, encode: Callable[[str], list[int]]
) -> list[int]:
    """A video and its soundtrack interleaved (`use_audio_in_video`, MiMo's `video_audio` content with its interleave
    length 0): per frame pair, its time, `vision_start`, its rows, `vision_end`, then `audio_start`, the soundtrack's
    rows from int(start x 6.25) to the next pair's (the last pair's to int(end_s x 6.25), at most all), `audio_end`.
    A pair the soundtrack has no rows left for is refused (MiMo's processor asserts it)."""
    starts = [f32(s) for s, _ in video.groups]
    out, at = [tokens.video_start], 0
    for i, (start, (_, n)) in enumerate(zip(starts, video.groups)):
        a0 = int(start * AUDIO_ROWS_PER_SECOND)
        a1 = int((starts[i + 1] if i + 1 < len(starts) else video.end_s) * AUDIO_ROWS_PER_SECOND)
        seg = min(a1, len(track.ids)) - a0
        if seg <= 0:
            raise LayoutError(
                f"use_audio_in_video: the soundtrack has {len(track.ids)} rows ({len(track.ids) / AUDIO_ROWS_PER_SECOND:.2f} "
                f"s), none for the frames at {timestamp(start)}"
            )
        out += encode(timestamp(start))
        out += [tokens.vision_start, *video.ids[at : at + n], tokens.vision_end]
        out += [tokens.audio_start, *track.ids[a0 : a0 + seg], tokens.audio_end]
        at += n
    out.append(tokens.video_end)
    return out


def _item(tokens: OmniTokens, items: Sequence[ItemRows], i: int, encode: Callable[[str], list[int]]) -> list[int]:
    """Item i's ids: a soundtrack's are its video's (none of its own); a video followed by its soundtrack
    interleaves them."""
    it = items[i]
    if it.in_video:
        if i == 0 or items[i - 1].kind != "video":
            raise LayoutError(f"media item {i} is a video's soundtrack with no video before it")
        return []
    if it.kind == "video" and i + 1 < len(items) and items[i + 1].in_video:
        return video_with_track(tokens, it, items[i + 1], encode)
    return item_ids(tokens, it, encode)


def layout(
    tokens: OmniTokens,
    text: str,
    items: Sequence[ItemRows],
    encode: Callable[[str], list[int]],
    head: Sequence[int] = (),
) -> list[int]:
    """The prompt ids of `head` + `text` with `items` in place of the text's placeholders (`encode`: text to ids,
    no special tokens added; `head`: ids before the text, e.g. a raw prompt's BOS, or a prompt given as ids with
    an empty text). Raises LayoutError naming the mismatch."""
    pieces = split_text(text)
    kinds = [k for k, _ in pieces if k]
    if not kinds:
        ids = [*head, *encode(text)] if text else list(head)
        media = [t for i in range(len(items)) for t in _item(tokens, items, i, encode)]
        return ids[:1] + media + ids[1:]
    if len(kinds) != len(items):
        raise LayoutError(f"the prompt has {len(kinds)} media placeholders for {len(items)} media items")
    out: list[int] = list(head)
    media_iter = iter(enumerate(items))
    for kind, piece in pieces:
        if not kind:
            out += encode(piece)
            continue
        i, it = next(media_iter)
        if it.kind != kind:
            raise LayoutError(f"media item {i} is {it.kind!r} but its place in the prompt is an {kind} placeholder")
        out += _item(tokens, items, i, encode)
    return out
