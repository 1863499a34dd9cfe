"""MiMo's omni prompt rules (mimo_epd/common/omni_prompt.py) on their own: the layout, its refusals, the config it
reads. Parity with vLLM's processor is tests/encoder/test_mimo_prompt_parity.py."""

from __future__ import annotations

import pytest

from mimo_epd.common.omni_prompt import (
    PLACEHOLDER,
    ItemRows,
    LayoutError,
    OmniTokens,
    first_media_at,
    layout,
    split_text,
    timestamp,
)

T = OmniTokens(10, 11, 12, 20, 21, 30, 31, 40, 41)  # pads image/video/audio, vision, audio, video start/end


def enc(s: str) -> list[int]:
    return [ord(c) + 100 for c in s]  # one id per character, all under 1000


def test_placeholders_split_the_text_with_any_number_of_pads():
    text = (
        "a"
        + PLACEHOLDER["image"]
        + "b"
        + "<|vision_start|>"
        + "<|video_pad|>" * 3
        + "<|vision_end|>"
        + PLACEHOLDER["audio"]
    )
    assert [k for k, _ in split_text(text)] == ["", "image", "", "video", "audio"]
    assert first_media_at(text) == 1 and first_media_at("plain") == -1
    assert [k for k, _ in split_text("<|vision_start|>x<|vision_end|>")] == [""]  # no pad: just text


def test_each_kind_is_framed_and_videos_carry_their_timestamps():
    img, aud = ItemRows("image", [1000, 1001]), ItemRows("audio", [2000])
    vid = ItemRows("video", [3000, 3001, 3002, 3003], groups=((0.0, 2), (61.5, 2)))
    text = "x" + PLACEHOLDER["image"] + PLACEHOLDER["video"] + "y" + PLACEHOLDER["audio"]
    ids = layout(T, text, [img, vid, aud], enc)
    assert ids == [
        *enc("x"),
        20, 1000, 1001, 21,
        40, *enc("00:00"), 20, 3000, 3001, 21, *enc("01:01"), 20, 3002, 3003, 21, 41,
        *enc("y"),
        30, 2000, 31,
    ]  # fmt: skip
    assert timestamp(3725.9) == "62:05"  # minutes keep counting past the hour


def test_a_text_without_placeholders_takes_the_items_after_its_first_token():
    img = ItemRows("image", [1000])
    assert layout(T, "ab", [img], enc) == [enc("a")[0], 20, 1000, 21, enc("b")[0]]
    assert layout(T, "", [img], enc, head=[7, 8]) == [7, 20, 1000, 21, 8]  # a prompt given as ids
    assert layout(T, "a" + PLACEHOLDER["image"], [img], enc, head=[5]) == [5, *enc("a"), 20, 1000, 21]


def test_mismatched_placeholders_are_refused_by_count_and_by_kind():
    img, aud = ItemRows("image", [1000]), ItemRows("audio", [2000])
    with pytest.raises(LayoutError, match="2 media placeholders for 1 media items"):
        layout(T, PLACEHOLDER["image"] * 2, [img], enc)
    with pytest.raises(LayoutError, match="media item 0 is 'audio' but its place in the prompt is an image"):
        layout(T, PLACEHOLDER["image"], [aud], enc)
    with pytest.raises(LayoutError, match="groups hold 3 rows, its embedding 2"):
        layout(T, PLACEHOLDER["video"], [ItemRows("video", [1, 2], groups=((0.0, 3),))], enc)


def test_a_soundtrack_is_interleaved_with_its_videos_frame_pairs():
    vid = ItemRows("video", [1, 2, 3, 4, 5, 6], groups=((0.0, 2), (0.5, 2), (1.0, 2)), end_s=1.5)
    track = ItemRows("audio", list(range(100, 110)), in_video=True)  # 10 rows: 1.6 s at 6.25 rows a second
    text = PLACEHOLDER["video"] + PLACEHOLDER["audio"]
    ids = layout(T, text, [vid, track], enc)
    # rows int(start x 6.25) .. int(next start x 6.25): 0..3, 3..6, 6..9 (the last to the span's end, 1.5 s)
    assert ids == [
        40,
        *enc("00:00"), 20, 1, 2, 21, 30, 100, 101, 102, 31,
        *enc("00:00"), 20, 3, 4, 21, 30, 103, 104, 105, 31,
        *enc("00:01"), 20, 5, 6, 21, 30, 106, 107, 108, 31,
        41,
    ]  # fmt: skip
    assert layout(T, "", [vid, track], enc, head=[7]) == [7, *ids]  # no placeholders: the same, after the first id
    short = ItemRows("audio", [100, 101, 102], in_video=True)
    with pytest.raises(LayoutError, match="the soundtrack has 3 rows .* none for the frames at 00:00"):
        layout(T, text, [vid, short], enc)
    with pytest.raises(LayoutError, match="soundtrack with no video before it"):
        layout(T, PLACEHOLDER["audio"], [track], enc)


def test_the_config_names_all_nine_tokens_or_none():
    keys = {
        "image_token_id": 10, "video_token_id": 11, "audio_token_id": 12,
        "vision_start_token_id": 20, "vision_end_token_id": 21, "audio_start_token_id": 30,
        "audio_end_token_id": 31, "video_start_token_id": 40, "video_end_token_id": 41,
    }  # fmt: skip
    assert OmniTokens.from_config({"processor_config": keys}) == T
    assert OmniTokens.from_config({}) is None and OmniTokens.from_config({"processor_config": {"fps": 2}}) is None
    with pytest.raises(ValueError, match="processor_config.video_end_token_id: expected a token id, got None"):
        OmniTokens.from_config({"processor_config": {k: v for k, v in keys.items() if k != "video_end_token_id"}})
    with pytest.raises(ValueError, match="image_token_id"):
        OmniTokens.from_config({"processor_config": {**keys, "image_token_id": True}})
