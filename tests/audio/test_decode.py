"""Audio decoding: every format PyAV writes here decodes to 16 kHz mono close to the source signal; time
ranges tile the file exactly like one sequential decode; bad files are refused with a reason."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from encoder_server.audio.decode import AudioError, AudioLimits, decode, plan_ranges, probe
from mimo_epd.testing.audio_gen import make_test_audio, speech_like

RATE = 16000


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio")
    out = {}
    for suffix, rate, channels in [(".wav", 16000, 1), (".flac", 16000, 1), (".mp3", 16000, 1), (".ogg", 16000, 1)]:
        out[suffix] = str(d / f"a{suffix}")
        make_test_audio(out[suffix], 6.0, rate=rate, channels=channels)
    out["stereo44"] = str(d / "s44.wav")
    make_test_audio(out["stereo44"], 6.0, rate=44100, channels=2)
    out["mono44"] = str(d / "m44.wav")
    make_test_audio(out["mono44"], 6.0, rate=44100, channels=1)
    out[".m4a"] = str(d / "a.m4a")
    make_test_audio(out[".m4a"], 6.0)
    out["long"] = str(d / "long.flac")
    make_test_audio(out["long"], 75.0, seed=3)
    return out


def _source() -> np.ndarray:
    return np.concatenate(list(speech_like(6.0, RATE, 0)))


@pytest.mark.parametrize("name", [".wav", ".flac", ".mp3", ".ogg", ".m4a"])
def test_formats_decode_to_the_signal(files, name):
    x = decode(files[name], RATE)
    ref = _source()
    assert x.dtype == np.float32 and abs(x.size - ref.size) < 0.1 * RATE
    # Lossless formats give the signal to 16-bit precision; lossy ones keep most of its energy. An encoder's
    # priming samples (AAC's 1024) shift the signal: the best lag within 2048 samples is compared.
    n = min(x.size, ref.size) - 2048
    err = min(np.linalg.norm(x[lag : lag + n] - ref[:n]) / np.linalg.norm(ref[:n]) for lag in range(0, 2049))
    limit = 1e-3 if name in (".wav", ".flac") else 0.5
    assert err < limit, f"{name}: relative error {err:.3g}"


def test_stereo_44k_is_downmixed_and_resampled(files):
    """Two equal channels at 44.1 kHz give the 16 kHz mono signal of one of them."""
    stereo, mono = decode(files["stereo44"], RATE), decode(files["mono44"], RATE)
    assert stereo.size == mono.size == 6 * RATE
    np.testing.assert_allclose(stereo, mono, atol=2e-4)


@pytest.mark.parametrize("name", ["long", "stereo44", ".mp3", ".ogg"])
def test_time_ranges_tile_like_one_decode(files, name):
    info = probe(files[name])
    whole = decode(files[name], RATE)
    tiles = np.concatenate(
        [decode(files[name], RATE, start_s=a, end_s=b) for a, b in plan_ranges(info.duration_s, 2.5)]
    )
    assert tiles.size == whole.size
    # Bit-identical without rate conversion; the resampler's vector code leaves last-bit differences (1e-8).
    np.testing.assert_allclose(tiles, whole, rtol=0, atol=0 if name in ("long", ".mp3") else 1e-6)


def test_plan_ranges_cover_the_file():
    assert plan_ranges(70.0, 30.0) == [(0.0, 30.0), (30.0, 60.0), (60.0, None)]
    assert plan_ranges(10.0, 30.0) == [(0.0, None)]


def _wav_with(path: str, rate: int, channels: int) -> bytes:
    data = bytearray(open(path, "rb").read())
    struct.pack_into("<H", data, 22, channels)
    struct.pack_into("<I", data, 24, rate)
    return bytes(data)


def test_bad_files_are_refused_with_reasons(files, tmp_path):
    wav = open(files[".wav"], "rb").read()
    flac = open(files[".flac"], "rb").read()
    cases = {
        "zero-length": (b"", "not a readable audio file"),
        "garbage": (b"\x00\x01garbage" * 100, "not a readable audio file"),
        "truncated wav": (wav[: len(wav) // 2], "truncated"),
        "truncated flac": (flac[: len(flac) // 2], "truncated"),
        "absurd rate": (_wav_with(files[".wav"], 10**9, 1), "sample rate"),
        "tiny rate": (_wav_with(files[".wav"], 1, 1), "sample rate"),
        "absurd channels": (_wav_with(files[".wav"], 16000, 200), "channels"),
        "header only": (wav[: wav.index(b"data") + 8], "no samples|truncated|not a readable"),
    }
    for what, (data, reason) in cases.items():
        with pytest.raises(AudioError, match=reason):
            decode(data, RATE)
        del what


def test_a_video_without_sound_has_no_audio_stream(tmp_path):
    from mimo_epd.testing.video_gen import make_test_video

    path = str(tmp_path / "v.mp4")
    make_test_video(path, 0.5, width=64, height=48)
    with pytest.raises(AudioError, match="no audio stream"):
        decode(path, RATE)


def test_duration_limit(files):
    with pytest.raises(AudioError, match="max-audio-seconds"):
        probe(files[".wav"], AudioLimits(max_seconds=2.0))
