"""The transformers reference of an audio item's embedding: PyAV decode to 16 kHz mono (one sequential pass),
`WhisperFeatureExtractor` per 30-s window, `Qwen2AudioEncoder` with the padding mask Qwen2-Audio builds, the
projector, and each window's valid tokens, with the weights of our tower copied in."""

from __future__ import annotations

import numpy as np
import torch


def hf_tower(ours):
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
    cfg._attn_implementation = "eager"
    enc = Qwen2AudioEncoder(cfg).eval()
    state = {k: v for k, v in ours.state_dict().items() if not k.startswith("proj.")}
    enc.load_state_dict(state)
    proj = torch.nn.Linear(c.d_model, c.out_hidden_size)
    proj.load_state_dict({"weight": ours.proj.weight, "bias": ours.proj.bias})
    return enc, proj


def hf_embedding(samples: np.ndarray, ours) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=ours.config.num_mel_bins)
    enc, proj = hf_tower(ours)
    w = fe.n_samples
    rows = []
    for i in range(0, max(1, samples.size), w):
        b = fe(samples[i : i + w], sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
        conv_len, out_len = enc._get_feat_extract_output_lengths(b["attention_mask"].sum(-1))
        if int(out_len[0]) <= 0:
            continue
        t = b["input_features"].shape[-1] // 2
        mask = torch.zeros(1, 1, t, t)
        mask[..., int(conv_len[0]) :] = torch.finfo(torch.float32).min
        with torch.no_grad():
            h = proj(enc(b["input_features"], attention_mask=mask).last_hidden_state)
        rows.append(h[0, : int(out_len[0])])
    return torch.cat(rows)


def pyav_samples(path_or_bytes) -> np.ndarray:
    """What a transformers user writes to load audio with PyAV: decode, resample to 16 kHz, mean of channels."""
    import io

    import av

    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with av.open(src) as c:
        st = c.streams.audio[0]
        rs = av.AudioResampler(format="fltp", rate=16000)
        parts = [f.to_ndarray().mean(0) for fr in c.decode(st) for f in rs.resample(fr)]
        parts += [f.to_ndarray().mean(0) for f in rs.resample(None)]
    return np.concatenate(parts).astype(np.float32)
