"""`mimo-epd serve --encoders 2`: router + two encoder processes sharing one shm cache."""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest

from mimo_epd.v1 import encoder_pb2 as pb
from mimo_epd.v1 import encoder_pb2_grpc
from tests.conftest import encode_image, start_server, textured

pytestmark = pytest.mark.integration


def encode(address, *items, timeout=60):
    ch = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)])
    return encoder_pb2_grpc.EncoderStub(ch).Encode(pb.EncodeRequest(items=list(items)), timeout=timeout)


def encoders_of(node) -> dict[str, int]:
    """endpoint -> pid, from the launcher's log lines."""
    out = {}
    for line in node.stderr_lines:
        m = re.search(r"encoder \d+ \(pid (\d+)\) serving on (\S+)", line)
        if m:
            out[m.group(2)] = int(m.group(1))
    return out


@pytest.fixture(scope="module")
def node():
    s = start_server(
        ["--encoders", "2", "--health-interval-s", "0.3", "--shm-cache-bytes", str(256 << 20), "--decode-workers", "1"],
        subcommand="serve",
    )
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)[-3000:]
    shm = [ln for ln in s.stderr_lines if "node cache: /dev/shm/" in ln]
    assert shm and not os.path.exists(re.search(r"(/dev/shm/\S+),", shm[0]).group(1)), "segment not removed"


def test_second_request_is_a_hit_and_items_come_back_in_order(node):
    imgs = [encode_image(textured(200 + 40 * i, 300, seed=300 + i), "JPEG") for i in range(6)]
    first = encode(node.address, *[pb.MediaItem(data=b) for b in imgs])
    assert [it.grid_thw[1] for it in first.items] == [round((200 + 40 * i) / 28) * 2 for i in range(6)]
    assert not any(it.cache_hit for it in first.items)
    second = encode(node.address, *[pb.MediaItem(data=b) for b in imgs])
    assert all(it.cache_hit for it in second.items)
    assert [a.embedding.data == b.embedding.data for a, b in zip(first.items, second.items)] == [True] * 6


def test_item_encoded_by_one_encoder_is_a_hit_on_the_other(node):
    eps = list(encoders_of(node))
    assert len(eps) == 2
    img = encode_image(textured(260, 340, seed=77), "JPEG")
    a = encode(eps[0], pb.MediaItem(data=img)).items[0]
    b = encode(eps[1], pb.MediaItem(data=img)).items[0]
    assert not a.cache_hit and b.cache_hit and a.embedding.data == b.embedding.data


def test_item_errors_keep_status_and_the_clients_index(node):
    good = pb.MediaItem(data=encode_image(textured(100, 100, seed=1), "JPEG"))
    with pytest.raises(grpc.RpcError) as ei:
        encode(node.address, good, good, pb.MediaItem(data=b"junk" * 10), good)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("item 2: "), ei.value.details()


def test_the_processes_serve_starts_use_two_malloc_arenas(node, monkeypatch):
    # glibc's per-thread arenas made the encoders' heap creep under load (mimo_epd/launcher.py: MALLOC_ARENAS)
    for pid in encoders_of(node).values():
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env.get(b"MALLOC_ARENA_MAX") == b"2", pid
    from mimo_epd.launcher import worker_env

    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert worker_env()["MALLOC_ARENA_MAX"] == "8"  # a value the user set wins


def test_killing_an_encoder_keeps_requests_succeeding_and_it_rejoins(node):
    eps = encoders_of(node)
    victim_ep, victim_pid = next(iter(eps.items()))
    os.kill(victim_pid, signal.SIGKILL)
    t_end = time.monotonic() + 30
    ok = 0
    i = 0
    while time.monotonic() < t_end and ok < 20:
        img = encode_image(textured(120, 160, seed=1000 + i), "JPEG")
        i += 1
        r = encode(node.address, pb.MediaItem(data=img), pb.MediaItem(data=img[::-1][::-1]))
        assert len(r.items) == 2
        ok += 1
    assert ok == 20
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if any("rejoined the ring" in ln and victim_ep in ln for ln in node.stderr_lines):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the killed encoder was not restarted and re-added: " + "".join(node.stderr_lines[-20:]))
    assert encode(victim_ep, pb.MediaItem(data=encode_image(textured(90, 90, seed=5), "PNG"))).items[0].num_tokens > 0


def test_video_through_the_router_keeps_timestamps_on_a_shared_cache_hit(node):
    import tempfile

    from mimo_epd.testing.video_gen import make_test_video

    with tempfile.TemporaryDirectory() as d:
        make_test_video(f"{d}/v.mp4", 10, width=160, height=120, preset="ultrafast")
        data = open(f"{d}/v.mp4", "rb").read()
    item = pb.MediaItem(data=data, modality=pb.VIDEO)
    a = encode(node.address, item, timeout=300).items[0]
    b = encode(node.address, item, timeout=300).items[0]
    assert not a.cache_hit and b.cache_hit
    assert a.video.frames_sampled == 20 and list(b.timestamps_s) == list(a.timestamps_s) and len(a.timestamps_s) == 10
    assert b.video.frames_total == a.video.frames_total == 300


def test_generate_with_an_image_through_the_node_router(node):
    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(node.address))
    img = encode_image(textured(140, 196, seed=11), "JPEG")
    req = generator_pb2.GenerateRequest(
        prompt="What is it?",
        media=[pb.MediaItem(data=img)],
        sampling=generator_pb2.SamplingOptions(max_tokens=5, ignore_eos=True),  # the trained model may stop sooner
    )
    msgs = list(stub.Generate(req, timeout=120))
    final = msgs[-1].final
    assert sum(len(m.delta.token_ids) for m in msgs[:-1]) == 5 and final.completion_tokens == 5
    assert final.media_tokens == 35  # 140x196 -> grid 10x14 -> 35 tokens
