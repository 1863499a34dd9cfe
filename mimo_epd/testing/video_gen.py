"""`mimo-epd make-test-video`: a realistic H.264 test video written with PyAV.

Moving textured content (a large photo-like texture panned across the frame, a moving object, slow
brightness drift and per-frame sensor noise), so motion estimation, B-frames and CABAC work as on real
footage at a realistic bitrate; 30 fps, keyframe interval 250, x264 `veryfast` (B-frames on), yuv420p.
With `audio_rate` (`--with-audio`) the file also carries a soundtrack: the speech-like signal of
`make-test-audio` (same seed), AAC mono at that rate, interleaved with the frames as a camera writes it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from mimo_epd.testing.audio_gen import speech_like
from mimo_epd.testing.media_server import photo_like


def make_test_video(
    out: str,
    seconds: float,
    width: int = 640,
    height: int = 360,
    fps: int = 30,
    gop: int = 250,
    preset: str = "veryfast",
    crf: int = 23,
    seed: int = 0,
    noise: int = 12,
    audio_rate: int = 0,
    progress=None,
) -> dict:
    import av

    if width % 2 or height % 2:
        raise ValueError("width and height must be even (yuv420p)")
    n = int(round(seconds * fps))
    if n < 1:
        raise ValueError("the video must last at least one frame")
    tex = photo_like(height * 2, width * 2, seed=seed)
    # Fresh sensor noise every frame (cycled from a bank, never repeating within x264's reference window):
    # real footage is never a perfectly motion-compensated pan, and noise sets a realistic bitrate.
    rng = np.random.default_rng(seed + 1)
    noise_bank = (
        [rng.integers(-noise, noise + 1, (height, width, 3), dtype=np.int16) for _ in range(17)] if noise else []
    )
    t0 = time.perf_counter()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with av.open(out, "w") as c:
        st = c.add_stream("libx264", rate=fps)
        st.width, st.height, st.pix_fmt = width, height, "yuv420p"
        st.options = {"preset": preset, "crf": str(crf), "g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"}
        sound = _Soundtrack(c, seconds, audio_rate, seed) if audio_rate else None
        for i in range(n):
            if sound is not None:
                sound.write_until((i + 1) / fps)
            ox = int((width / 2) * (1 + math.sin(i / 400.0)))
            oy = int((height / 2) * (1 + math.cos(i / 530.0)))
            frame = tex[oy : oy + height, ox : ox + width].copy()
            bx, by = int((i * 3) % (width - 40)), int((height - 40) * (0.5 + 0.4 * math.sin(i / 60.0)))
            frame[by : by + 40, bx : bx + 40] = (230, 40, 40)
            if noise_bank:
                frame = np.clip(frame.astype(np.int16) + noise_bank[i % len(noise_bank)], 0, 255).astype(np.uint8)
            if i % 90 == 0:
                drift = np.int16(20 * math.sin(i / 900.0))
                tex = np.clip(tex.astype(np.int16) + drift // 10, 0, 255).astype(np.uint8)
            for pkt in st.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(pkt)
            if progress and i % 300 == 0:
                progress(i, n)
        for pkt in st.encode():
            c.mux(pkt)
        if sound is not None:
            sound.close()
    return {
        "path": out,
        "frames": n,
        "seconds": seconds,
        "fps": fps,
        "resolution": f"{width}x{height}",
        "gop": gop,
        "audio": {"codec": "aac", "rate": audio_rate, "channels": 1} if audio_rate else None,
        "bytes": Path(out).stat().st_size,
        "generate_s": round(time.perf_counter() - t0, 2),
    }


class _Soundtrack:
    """The speech-like signal as an AAC stream of container `c`, written up to a time as the frames go."""

    def __init__(self, c, seconds: float, rate: int, seed: int):
        import av

        self.rate = rate
        self.st = c.add_stream("aac", rate=rate, layout="mono")
        self.c = c
        self.resampler = av.AudioResampler(format=self.st.codec_context.format.name, layout="mono", rate=rate)
        self.blocks = speech_like(seconds, rate, seed, block_s=0.1)
        self.written = 0

    def _mux(self, frames) -> None:
        for f in frames:
            for p in self.st.encode(f):
                self.c.mux(p)

    def write_until(self, t: float) -> None:
        import av

        while self.written < t * self.rate:
            blk = next(self.blocks, None)
            if blk is None:
                return
            frame = av.AudioFrame.from_ndarray(blk[None, :], format="flt", layout="mono")
            frame.sample_rate = self.rate
            self._mux(self.resampler.resample(frame))
            self.written += blk.size

    def close(self) -> None:
        self.write_until(float("inf"))
        self._mux(self.resampler.resample(None))
        for p in self.st.encode(None):
            self.c.mux(p)
