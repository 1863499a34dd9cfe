"""The shared prompt rules: the worker's parser and the router's front read messages through one function, so
they agree on every input (the router's affinity predictions depend on it), and no JSON value makes either
raise anything but its own refusal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backend.agentic.tools import ToolError, template_message
from llm_backend.server import openai_protocol as proto
from llm_backend.server.core import ServeError
from mimo_epd.common.parent import pid_alive
from mimo_epd.common.prompt_rules import RuleError, audio_in_video, encode_text, normalize_messages
from mimo_epd.router.http_front import Unroutable, chat_messages
from mimo_epd.v1.encoder_pb2 import AUDIO, IMAGE, VIDEO

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "video_url", "audio", 3, None])},
    optional={"text": json_values, "image_url": json_values, "video_url": json_values},
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", 1, ["user"], {"a": 1}])},
    optional={"content": st.one_of(json_values, st.lists(part, max_size=3))},
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(json_values, st.lists(message, max_size=4)))
def test_router_and_worker_agree_on_any_messages(messages):
    try:
        want, refs = normalize_messages(messages, build=template_message)  # what both pass
    except (RuleError, ToolError) as e:
        with pytest.raises(ServeError) as err:
            proto.parse_chat({"messages": messages})
        assert err.value.http_status == 400 and err.value.param == e.param
        with pytest.raises(Unroutable):
            chat_messages(messages)
        return
    req = proto.parse_chat({"messages": messages})
    assert req.messages == want and len(req.media) == len(refs)
    assert chat_messages(messages) == (want, bool(refs))


def test_roles_that_are_not_strings_are_refused_by_name():
    for role in (["user"], {"x": 1}, 3, None):
        with pytest.raises(RuleError) as e:
            normalize_messages([{"role": role, "content": "hi"}])
        assert e.value.param == "messages[0].role"


def test_media_parts_come_back_in_order_with_their_field():
    msgs, refs = normalize_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": "https://h/v.mp4"}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": "data:image/png;base64,AA=="},
                ],
            }
        ]
    )
    assert msgs[0]["content"] == [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"}]
    assert [(r.kind, r.param) for r in refs] == [
        ("video", "messages[0].content[0].video_url.url"),
        ("image", "messages[0].content[2].image_url.url"),
    ]


def test_encode_text_special_tokens():
    class Inner:
        def encode(self, text, add_special_tokens):
            return type("E", (), {"ids": [ord(c) for c in text]})()

    class Tok:
        tok = Inner()

        def encode(self, text):
            return [1] + [ord(c) for c in text]

    assert encode_text(Tok(), "ab") == [1, 97, 98]
    assert encode_text(Tok(), "ab", add_special_tokens=False) == [97, 98]


def test_pid_alive_one_rule():
    import shm_cache

    assert shm_cache.pid_alive is pid_alive
    assert pid_alive(os.getpid())
    assert not pid_alive(0) and not pid_alive(-1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


def test_audio_parts():
    import base64

    wav = b"RIFF....WAVEfmt "
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                {"type": "audio_url", "audio_url": {"url": "https://example.com/a.mp3"}},
            ],
        }
    ]
    out, refs = normalize_messages(messages)
    assert [p["type"] for p in out[0]["content"]] == ["text", "audio", "audio"]
    assert [(r.kind, r.data, r.url) for r in refs] == [("audio", wav, ""), ("audio", None, "https://example.com/a.mp3")]
    bad = {
        "messages[0].content[0].input_audio.data": {"data": "!!", "format": "wav"},
        "messages[0].content[0].input_audio.format": {"data": "AAAA", "format": "midi"},
        "messages[0].content[0].input_audio": "AAAA",
    }
    for param, ref in bad.items():
        with pytest.raises(RuleError) as ei:
            normalize_messages([{"role": "user", "content": [{"type": "input_audio", "input_audio": ref}]}])
        assert ei.value.param == param


def test_use_audio_in_video_puts_each_videos_soundtrack_after_it():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": "https://example.com/a.jpg"},
                {"type": "video_url", "video_url": "https://example.com/w.mp4"},
            ],
        }
    ]
    out, refs = normalize_messages(messages, audio_in_video=True)
    assert [p["type"] for p in out[0]["content"]] == ["video", "audio", "text", "image", "video", "audio"]
    assert [(r.kind, r.url.rsplit("/", 1)[1], r.track_of) for r in refs] == [
        ("video", "v.mp4", ""),
        ("audio", "v.mp4", "messages[0].content[0].video_url.url"),
        ("image", "a.jpg", ""),
        ("video", "w.mp4", ""),
        ("audio", "w.mp4", "messages[0].content[3].video_url.url"),
    ]
    plain_out, plain_refs = normalize_messages(messages)
    assert len(plain_refs) == 3 and [p["type"] for p in plain_out[0]["content"]][:2] == ["video", "text"]
    # The worker and the router read the flag alike and agree on the result.
    body = {"messages": messages, "mm_processor_kwargs": {"use_audio_in_video": True}}
    req = proto.parse_chat(body)
    assert req.messages == normalize_messages(messages, build=template_message, audio_in_video=True)[0]
    assert [m.modality for m in req.media] == [VIDEO, AUDIO, IMAGE, VIDEO, AUDIO]
    assert req.media[1].url == req.media[0].url
    assert req.media_names[1] == "messages[0].content[0].video_url.url, its audio track (use_audio_in_video)"
    assert chat_messages(messages, True) == (req.messages, True)


@pytest.mark.parametrize(
    "body, want",
    [
        ({}, False),
        ({"use_audio_in_video": True}, True),
        ({"use_audio_in_video": False}, False),
        ({"mm_processor_kwargs": {"use_audio_in_video": True}}, True),
        ({"mm_processor_kwargs": {}}, False),
        ({"mm_processor_kwargs": None}, False),
        ({"use_audio_in_video": True, "mm_processor_kwargs": {"use_audio_in_video": True}}, True),
        ({"use_audio_in_video": 1}, "use_audio_in_video"),
        ({"use_audio_in_video": None}, "use_audio_in_video"),
        ({"mm_processor_kwargs": "x"}, "mm_processor_kwargs"),
        ({"mm_processor_kwargs": {"use_audio_in_video": "true"}}, "mm_processor_kwargs.use_audio_in_video"),
        ({"use_audio_in_video": False, "mm_processor_kwargs": {"use_audio_in_video": True}}, "disagrees"),
    ],
)
def test_the_use_audio_in_video_flag(body, want):
    if isinstance(want, bool):
        assert audio_in_video(body) is want
        return
    with pytest.raises(RuleError) as ei:
        audio_in_video(body)
    assert want in (ei.value.param if want != "disagrees" else ei.value.message)
