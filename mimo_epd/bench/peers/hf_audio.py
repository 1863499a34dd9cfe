"""The path a competent transformers user writes for a long audio file: PyAV decodes the whole file in one
pass (resampled to 16 kHz per channel, channels averaged, as librosa's loader does), `WhisperFeatureExtractor`
featurises the 30-s windows in batches (its torch STFT), and transformers' `Qwen2AudioEncoder` with the
padding mask Qwen2-Audio builds, plus the projector, encodes them in batches; each window keeps its valid
tokens. The weights are copied from our tower, so both paths compute the same function."""

from __future__ import annotations

import time

import numpy as np
import torch


def load_pyav(path: str, rate: int = 16000) -> np.ndarray:
    import av

    with av.open(path) as c:
        st = c.streams.audio[0]
        rs = av.AudioResampler(format="fltp", rate=rate)
        parts = [f.to_ndarray().mean(0) for fr in c.decode(st) for f in rs.resample(fr)]
        parts += [f.to_ndarray().mean(0) for f in rs.resample(None)]
    return np.concatenate(parts).astype(np.float32)


def hf_modules(ours):
    from transformers.models.qwen2_audio.configuration_qwen2_audio import Qwen2AudioEncoderConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    c = ours.config
    cfg = Qwen2AudioEncoderConfig(
        num_mel_bins=c.num_mel_bins,
        d_model=c.d_model,
        encoder_layers=c.encoder_layers,
        encoder_attention_heads=c.encoder_attention_heads,
        encoder_ffn_dim=c.encoder_ffn_dim,
        max_source_positions=c.max_source_positions,
        activation_function=c.activation_function,
    )
    cfg._attn_implementation = "sdpa"
    enc = Qwen2AudioEncoder(cfg).eval().to(ours.device, ours.dtype)
    enc.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("proj.")})
    proj = torch.nn.Linear(c.d_model, c.out_hidden_size).to(ours.device, ours.dtype)
    proj.load_state_dict({"weight": ours.proj.weight, "bias": ours.proj.bias})
    return enc, proj


@torch.inference_mode()
def encode_windows(enc, proj, feats: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    conv_len, out_len = enc._get_feat_extract_output_lengths(frames)
    b, t = feats.shape[0], feats.shape[-1] // 2
    keep = torch.arange(t)[None, :] < conv_len[:, None]
    mask = torch.zeros(b, 1, t, t, dtype=enc.dtype)
    mask.masked_fill_(~keep[:, None, None, :], torch.finfo(enc.dtype).min)
    h = proj(enc(feats.to(enc.device, enc.dtype), attention_mask=mask.to(enc.device)).last_hidden_state)
    sel = torch.arange(h.shape[1])[None, :] < out_len[:, None]
    return h[sel.to(h.device)].cpu()


def run(path: str, ours, batch_windows: int = 8, device: str = "cpu") -> tuple[torch.Tensor, dict]:
    from transformers import WhisperFeatureExtractor

    seconds = {}
    t0 = time.perf_counter()
    samples = load_pyav(path)
    seconds["decode"] = time.perf_counter() - t0
    fe = WhisperFeatureExtractor(feature_size=ours.config.num_mel_bins)
    enc, proj = hf_modules(ours)
    w = fe.n_samples
    windows = [samples[i : i + w] for i in range(0, samples.size, w)]
    out, feat_s, enc_s = [], 0.0, 0.0
    for i in range(0, len(windows), batch_windows):
        t1 = time.perf_counter()
        b = fe(
            windows[i : i + batch_windows],
            sampling_rate=16000,
            return_tensors="pt",
            return_attention_mask=True,
            device=device,
        )
        t2 = time.perf_counter()
        frames = b["attention_mask"].sum(-1)
        keep = enc._get_feat_extract_output_lengths(frames)[1] > 0
        if keep.any():
            out.append(encode_windows(enc, proj, b["input_features"][keep], frames[keep]))
        t3 = time.perf_counter()
        feat_s, enc_s = feat_s + t2 - t1, enc_s + t3 - t2
    seconds.update(features=feat_s, encode=enc_s)
    return torch.cat(out), seconds
