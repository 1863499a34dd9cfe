"""`mimo-epd make-test-audio`: a reproducible speech-like test signal, written with PyAV.

The signal is voiced speech in outline: a glottal source whose pitch glides between 90 and 260 Hz,
rendered as a sum of harmonics whose amplitudes follow three formant resonances that move from
syllable to syllable (vowel-like spectra), a syllable envelope at about 4 Hz, short pauses between
words, breath-like noise in the gaps and a little background noise. The same `seed` gives the same
samples on every machine; samples are generated block by block, so an hour never sits in memory as
float64 and the file is written as it is produced.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

# A few vowel-like formant sets (F1, F2, F3 in Hz).
_VOWELS = np.array([[730, 1090, 2440], [270, 2290, 3010], [300, 870, 2240], [530, 1840, 2480], [570, 840, 2410]])
_BANDWIDTH = np.array([90.0, 110.0, 170.0])
_CODECS = {".wav": "pcm_s16le", ".flac": "flac", ".mp3": "libmp3lame", ".ogg": "libopus", ".opus": "libopus"}
_CODECS.update({".m4a": "aac", ".aac": "aac"})


def speech_like(seconds: float, rate: int = 16000, seed: int = 0, block_s: float = 1.0):
    """Yields float32 mono blocks of the signal, `block_s` seconds each (the last may be shorter)."""
    rng = np.random.default_rng(seed)
    total = int(round(seconds * rate))
    syll = 0.25  # seconds per syllable
    n_syll = int(math.ceil(seconds / syll)) + 2
    vowels = _VOWELS[rng.integers(0, len(_VOWELS), n_syll)].astype(np.float64)
    pitch = 90 + 170 * rng.random(n_syll)
    pause = rng.random(n_syll) < 0.15
    loud = 0.3 + 0.5 * rng.random(n_syll)
    phase = 0.0
    block = max(1, int(block_s * rate))
    for start in range(0, total, block):
        n = min(block, total - start)
        t = (start + np.arange(n)) / rate
        s = t / syll
        i = np.floor(s).astype(np.int64)
        frac = s - i
        f0 = pitch[i] + (pitch[i + 1] - pitch[i]) * frac
        inst = phase + 2 * np.pi * np.cumsum(f0) / rate
        phase = float(inst[-1])
        formants = vowels[i] + (vowels[i + 1] - vowels[i]) * frac[:, None]
        out = np.zeros(n)
        # Harmonic amplitudes change slowly: computed every `hop` samples and held in between.
        hop = 80
        f0c, fmc = f0[::hop], formants[::hop]
        for k in range(1, 25):
            fk = k * f0c
            amp = np.exp(-0.5 * (((fk[:, None] - fmc) / _BANDWIDTH) ** 2)).sum(1) / k
            amp *= fk < rate / 2
            out += np.repeat(amp, hop)[:n] * np.sin(k * inst)
        env = np.sin(np.pi * frac) ** 2 * loud[i] * ~pause[i]
        noise = np.random.default_rng((seed, start)).standard_normal(n)
        out = out * env * 0.3 + noise * (0.004 + 0.02 * (pause[i] * np.sin(np.pi * frac) ** 2))
        yield np.clip(out, -1.0, 1.0).astype(np.float32)


def make_test_audio(out: str, seconds: float, rate: int = 16000, seed: int = 0, channels: int = 1, progress=None):
    """Writes the signal to `out`; the container and codec follow the suffix (.wav .flac .mp3 .ogg .m4a)."""
    import av

    if seconds <= 0:
        raise ValueError("the audio must last more than 0 seconds")
    suffix = Path(out).suffix.lower()
    if suffix not in _CODECS:
        raise ValueError(f"unknown audio suffix {suffix!r}; choose one of {sorted(_CODECS)}")
    codec = _CODECS[suffix]
    # Opus encodes at 48 kHz only; the other codecs take the rate as given.
    enc_rate = 48000 if codec == "libopus" else rate
    layout = "mono" if channels == 1 else "stereo"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with av.open(out, "w") as c:
        st = c.add_stream(codec, rate=enc_rate, layout=layout)
        resampler = av.AudioResampler(format=st.codec_context.format.name, layout=layout, rate=enc_rate)
        for blk in speech_like(seconds, rate, seed):
            data = np.ascontiguousarray(np.repeat(blk[None, :], channels, 0))
            frame = av.AudioFrame.from_ndarray(data, format="fltp", layout=layout)
            frame.sample_rate = rate
            for f in resampler.resample(frame):
                for p in st.encode(f):
                    c.mux(p)
            written += blk.size
            if progress is not None:
                progress(written / rate)
        for f in resampler.resample(None):
            for p in st.encode(f):
                c.mux(p)
        for p in st.encode(None):
            c.mux(p)
    return {"path": out, "seconds": seconds, "rate": rate, "codec": codec, "bytes": Path(out).stat().st_size}
