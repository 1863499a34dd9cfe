"""Video containers fuzzed through a real encoder: small real MP4 and Matroska files (PyAV, H.264), mutated
(box / element size fields, header fields, truncation, bit flips), plus fuzzed VideoOptions.

Every reply must be a success or INVALID_ARGUMENT; never INTERNAL, never a hang; the server stays up.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mimo_epd.v1 import encoder_pb2 as pb
from tests.fuzz.conftest import fuzz_settings
from tests.fuzz.mutate import edit_container, mutated

pytestmark = pytest.mark.integration

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[str, bytes]]:
    from mimo_epd.testing.video_gen import make_test_video

    d = tmp_path_factory.mktemp("videos")
    out = {}
    for name in ("clip.mp4", "clip.mkv"):
        make_test_video(str(d / name), 2, width=64, height=48, fps=10, gop=5, preset="ultrafast", noise=4)
        out[name] = ("VIDEO", (d / name).read_bytes())
    return out


def video_item(data: bytes, **opts) -> pb.MediaItem:
    return pb.MediaItem(data=data, modality=pb.VIDEO, video=pb.VideoOptions(**opts))


def test_corpus_is_valid(fuzz_server, corpus):
    for name, (_, data) in corpus.items():
        out = fuzz_server.encode(video_item(data, max_frames=8), deadline_s=60)
        assert out.code == grpc.StatusCode.OK, (name, out)
        assert out.resp.items[0].video.frames_sampled == 4  # 2 s at the default 2 fps


@fuzz_settings(10)
@given(data=st.data())
def test_mutated_containers(fuzz_server, corpus, data):
    desc, blob = data.draw(mutated(corpus, editor_for=lambda fmt: edit_container))
    out = fuzz_server.encode(video_item(blob, max_frames=8), deadline_s=60)
    assert out.code in ALLOWED, (desc, out)


@fuzz_settings(10)
@given(
    fps=st.sampled_from([0.0, -1.0, 1e-9, 1e9, math.inf, -math.inf, math.nan]) | st.floats(-10, 100),
    max_frames=st.sampled_from([0, 1, 2, 3, -1, 769, 1 << 30, -(1 << 31)]) | st.integers(-5, 40),
    min_frames=st.sampled_from([0, 1, -1, 1 << 30]) | st.integers(-5, 40),
)
def test_video_options(fuzz_server, corpus, fps, max_frames, min_frames):
    out = fuzz_server.encode(
        video_item(corpus["clip.mp4"][1], fps=fps, max_frames=max_frames, min_frames=min_frames), deadline_s=60
    )
    assert out.code in ALLOWED, (fps, max_frames, min_frames, out)
    if out.code == grpc.StatusCode.OK:
        v = out.resp.items[0].video
        assert 0 < v.frames_sampled <= 768 and v.frames_sampled <= v.frames_total, v
