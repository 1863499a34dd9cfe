"""MiMo's audio a segment at a time (`MiMoAudioStream`, what long items take in the encoder): rows equal to the whole
item's (`MiMoAudioModel.embed`, parity-tested against vLLM in test_mimo_audio_parity.py), bit for bit, whatever the
pushes, at the awkward lengths: under one segment, a one-frame last segment, a last segment that joins its
predecessors' tokenizer call (so its padding is theirs) and one that starts a call of its own."""

from __future__ import annotations

import pytest
import torch

import encoder_server.models.mimo_audio as ma

SEG = 6000 * 240  # samples per 60-s segment


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from llm_backend.models.make_checkpoint import write_checkpoint

    d = str(tmp_path_factory.mktemp("v25"))
    write_checkpoint(d, "v2.5", "bf16")
    return d


@pytest.fixture(scope="module")
def model(checkpoint):
    return ma.load_mimo_audio(checkpoint)


def _streamed(model, x: torch.Tensor, pushes: list[int]) -> torch.Tensor:
    st, out, at = ma.MiMoAudioStream(model), [], 0
    for n in [*pushes, x.numel()]:
        out += st.push(x[at : at + n])
        at += n
        if at >= x.numel():
            break
    out += st.finish()
    assert st.buf.numel() < SEG + 2000  # never more than a segment's samples held
    return torch.cat(out)


@pytest.mark.parametrize(
    "n, pushes",
    [
        (24000 * 10 + 7, [1000, 50000]),  # under one segment
        (SEG * 2, [SEG]),  # the last segment is one frame (centred on the last sample)
        (SEG * 2 + 239, [100, SEG + 5]),
        (SEG * 2 + 240 * 3000, [SEG, 1000, 700000]),
    ],
)
def test_streamed_rows_equal_the_whole_items(model, n, pushes):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.1
    want = model.embed(x)
    got = _streamed(model, x, pushes)
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("tail, full", [(2000, 2), (4000, 2), (1000, 3)])
def test_the_last_segment_is_padded_as_its_tokenizer_call_pads_it(model, monkeypatch, tail, full):
    """With calls of 15,000 frames (two full segments), a last segment of 2,000 frames joins the first call and is
    padded to 6,000 with it; one of 4,000 starts a call alone; after three full segments it shares the second."""
    monkeypatch.setattr(ma, "MAX_CALL_FRAMES", 15000)
    x = torch.randn(SEG * full + 240 * tail, generator=torch.Generator().manual_seed(tail)) * 0.1
    assert torch.equal(_streamed(model, x, [SEG]), model.embed(x))
    mel = ma.log_mel(x[: 240 * tail])  # the padding is not a no-op: it changes a short segment's codes
    assert not torch.equal(model.tokenizer.segment_codes(mel, 0), model.tokenizer.segment_codes(mel, 6000))


def test_a_mel_span_equals_the_whole_items_frames():
    x = torch.randn(24000 * 3 + 17, generator=torch.Generator().manual_seed(3))
    whole = ma.log_mel(x)
    t = whole.shape[0]
    for a, b in [(0, t), (0, 7), (t - 5, t), (100, 201)]:
        lo, hi = max(0, a * 240 - 480), min(x.numel(), (b - 1) * 240 + 480)
        lo, hi = (0 if a * 240 < 480 else lo), (x.numel() if (b - 1) * 240 + 480 > x.numel() else hi)
        assert torch.equal(ma.log_mel_span(x[lo:hi], lo, x.numel(), a, b), whole[a:b])
    with pytest.raises(ValueError, match="need samples"):
        ma.log_mel_span(x[1000:], 1000, x.numel(), 0, 5)


def test_a_long_item_through_the_encoder_is_streamed_and_equals_the_whole_items(model, checkpoint):
    """An encoder serving a v2.5 checkpoint, a 130-s clip over 60-s ranges (three ranges, decoded ahead, pushed into
    the stream): the reply's rows are MiMo's model on the whole clip's samples (16-bit PCM at 24 kHz: exact)."""
    import io
    import wave

    import grpc
    import numpy as np

    from mimo_epd.testing.servers import start_server
    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    d = checkpoint
    t = np.arange(24000 * 130) / 24000
    pcm = (6000 * np.sin(2 * np.pi * (200 + 30 * t) * t) + 800 * np.sin(7 * t)).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000), w.writeframes(pcm.tobytes())
    s = start_server(["--model", d, "--audio-chunk-seconds", "60", "--audio-parallel-above-s", "60"], "encoder")
    try:
        with grpc.insecure_channel(s.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            item = (
                encoder_pb2_grpc.EncoderStub(ch)
                .Encode(
                    encoder_pb2.EncodeRequest(
                        items=[encoder_pb2.MediaItem(data=buf.getvalue(), modality=encoder_pb2.AUDIO)]
                    ),
                    timeout=300,
                )
                .items[0]
            )
    finally:
        assert s.stop() == 0
    got = torch.frombuffer(bytearray(item.embedding.data), dtype=getattr(torch, item.embedding.dtype))
    want = model.embed(torch.from_numpy(pcm.astype(np.float32) / 32768))
    assert item.num_tokens == want.shape[0] == ma.num_tokens(1 + pcm.size // 240)
    got = got.view(want.shape).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("n", [24000 * 10 + 7, SEG * 2 + 240 * 3000])
def test_rows_from_the_streams_codes_equal_its_rows(model, n):
    """A cached codes entry gives back the item's rows exactly: the encoder over each segment's codes, as the stream
    runs it (under one segment, and a last segment joined to its predecessor's tokenizer call)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.1
    st, rows = ma.MiMoAudioStream(model), []
    rows += st.push(x)
    rows += st.finish()
    codes = torch.cat(st.codes)
    assert codes.shape[0] == ma.num_codes(1 + n // 240, 6000) and torch.equal(codes, model.codes(x))
    assert torch.equal(model.rows_from_codes(codes.to(torch.int32)), torch.cat(rows))


def test_an_item_whose_rows_were_evicted_is_answered_from_its_cached_codes(checkpoint):
    """An encoder whose cache keeps an item's codes after its rows were evicted (the codes are a few percent of the
    rows' bytes): the item again costs the encoder's part only (no decode, no tokenizer), and its rows are the
    first answer's, bit for bit (`encoder_cache_lookups_total{result="codes_hit"}`)."""
    import io
    import json
    import os
    import wave

    import grpc
    import numpy as np

    from mimo_epd.testing.redis_server import free_port
    from mimo_epd.testing.servers import scrape, start_server
    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    def wav(seed: int) -> bytes:
        t = np.arange(24000 * 3) / 24000
        pcm = (5000 * np.sin(2 * np.pi * (150 + 40 * seed) * t)).astype("<i2")
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000), w.writeframes(pcm.tobytes())
        return buf.getvalue()

    tok = json.load(open(os.path.join(checkpoint, "audio_tokenizer", "config.json")))
    frames = ma.num_codes(1 + 24000 * 3 // 240, 6000)
    tokens = ma.num_tokens(1 + 24000 * 3 // 240)
    hidden = json.load(open(os.path.join(checkpoint, "config.json")))["hidden_size"]
    rows_b, codes_b = tokens * hidden * 4, frames * tok["num_quantizers"] * 4
    # Two items of one length: A's rows, A's codes, B's rows fit; B's codes push out the oldest entry, A's rows.
    cap = 2 * rows_b + codes_b + codes_b // 2
    port = free_port()
    s = start_server(["--model", checkpoint, "--cache-bytes", str(cap), "--metrics-port", str(port)], "encoder")
    try:
        with grpc.insecure_channel(s.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            stub = encoder_pb2_grpc.EncoderStub(ch)

            def encode(data):
                req = encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(data=data, modality=encoder_pb2.AUDIO)])
                return stub.Encode(req, timeout=120).items[0]

            a, b = wav(0), wav(1)
            first = encode(a)
            assert first.num_tokens == tokens
            encode(b)
            again = encode(a)
        m = scrape(port)
    finally:
        assert s.stop() == 0
    assert again.embedding.data == first.embedding.data and not again.cache_hit
    assert m['encoder_cache_lookups_total{result="codes_stored"}'] == 2
    assert m['encoder_cache_lookups_total{result="codes_hit"}'] == 1
