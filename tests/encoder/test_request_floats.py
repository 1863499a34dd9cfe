"""Every float of an Encode request is checked at the edge: a video item whose sampling fps is NaN, infinite or
negative is INVALID_ARGUMENT naming the item and the field (it used to reach `int(NaN)`: INTERNAL)."""

from __future__ import annotations

import math

import grpc
import pytest

from encoder_server.errors import ItemError
from encoder_server.service import item_from_proto
from encoder_server.video.sampling import VideoSampling
from mimo_epd.v1 import encoder_pb2 as pb


@pytest.mark.parametrize("fps", [math.nan, math.inf, -math.inf, -1.0])
def test_bad_fps_is_invalid_argument(fps):
    item = pb.MediaItem(url="http://127.0.0.1/v.mp4", modality=pb.VIDEO, video=pb.VideoOptions(fps=fps))
    with pytest.raises(ItemError) as e:
        item_from_proto(item, 3)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.index == 3
    assert "video.fps" in e.value.reason
    with pytest.raises(ValueError):
        VideoSampling(fps=fps).validate()


def test_default_and_normal_fps_pass():
    for fps in (0.0, 0.5, 2.0, 30.0):
        req = item_from_proto(pb.MediaItem(url="http://h/v.mp4", modality=pb.VIDEO, video=pb.VideoOptions(fps=fps)), 0)
        assert req.video_fps == fps
