"""Audio tower parity with transformers' `Qwen2AudioEncoder` + `Qwen2AudioMultiModalProjector` (fp32).

Each config is built by transformers with random weights; ours loads the same state dict. A batch of
windows with different valid lengths (full, partial, very short) goes through transformers' forward with
the padding mask Qwen2-Audio builds, the projector, and the selection of each window's valid tokens; ours
must give the same packed tokens. Measured: relative L2 about 1e-7, max abs diff about 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from encoder_server.audio.features import AudioFeatureConfig, LogMel
from encoder_server.models.qwen2_audio import AudioTowerConfig, Qwen2AudioTower, tokens_per_window
from mimo_epd.testing.audio_gen import speech_like

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_audio.configuration_qwen2_audio import Qwen2AudioEncoderConfig  # noqa: E402
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder  # noqa: E402

REL_L2 = 1e-5

CONFIGS = {
    "gelu-2-layers": dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96),
    "relu-3-layers-wide-heads": dict(
        d_model=48, encoder_layers=3, encoder_attention_heads=2, encoder_ffn_dim=80, activation_function="relu"
    ),
}


def _reference(enc: Qwen2AudioEncoder, proj: torch.nn.Linear, feats: torch.Tensor, frames: torch.Tensor):
    """What Qwen2AudioModel does with `input_features` and `feature_attention_mask`."""
    conv_len, out_len = enc._get_feat_extract_output_lengths(frames)
    t = feats.shape[-1] // 2
    keep = torch.arange(t)[None, :] < conv_len[:, None]
    mask = torch.zeros(feats.shape[0], 1, t, t)
    mask.masked_fill_(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    hidden = proj(enc(feats, attention_mask=mask).last_hidden_state)
    sel = torch.arange(hidden.shape[1])[None, :] < out_len[:, None]
    return hidden[sel]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tower_equals_qwen2_audio_encoder(name):
    torch.manual_seed(0)
    hf_cfg = Qwen2AudioEncoderConfig(num_mel_bins=128, max_source_positions=1500, **CONFIGS[name])
    hf_cfg._attn_implementation = "eager"
    enc = Qwen2AudioEncoder(hf_cfg).eval()
    with torch.no_grad():  # the position table is a learned weight in checkpoints: make it non-trivial
        enc.embed_positions.weight.normal_(0, 0.02)
    proj = torch.nn.Linear(hf_cfg.d_model, 40)
    ours = Qwen2AudioTower(
        AudioTowerConfig(
            num_mel_bins=128,
            max_source_positions=1500,
            out_hidden_size=40,
            **CONFIGS[name],
        )
    ).eval()
    state = dict(enc.state_dict()) | {f"proj.{k}": v for k, v in proj.state_dict().items()}
    ours.load_state_dict(state, strict=True)

    cfg = AudioFeatureConfig()
    lm = LogMel(cfg)
    signal = torch.from_numpy(next(speech_like(70.0, cfg.sampling_rate, seed=5, block_s=70.0)))
    windows, valid = lm.windows(signal)  # 30 s, 30 s, 10 s
    short, _ = lm.windows(signal[: int(0.37 * cfg.sampling_rate)])  # 0.37 s: a few tokens
    feats = lm(torch.cat([windows, short]))
    frames = torch.tensor([lm.valid_frames(v) for v in valid] + [lm.valid_frames(int(0.37 * cfg.sampling_rate))])
    with torch.no_grad():
        ref = _reference(enc, proj, feats, frames)
        got = ours(feats, frames)
    assert got.shape == ref.shape == (int(tokens_per_window(frames).sum()), 40)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < REL_L2, f"{name}: relative L2 {rel:.2e}, max abs {(got - ref).abs().max().item():.2e}"
    # Each window alone gives its rows of the batch (the batcher relies on it).
    n = tokens_per_window(frames).tolist()
    with torch.no_grad():
        alone = ours(feats[3:4], frames[3:4])
    torch.testing.assert_close(alone, got[sum(n[:3]) :], rtol=1e-5, atol=1e-5)


def test_loads_a_qwen2_audio_checkpoint_layout(tmp_path):
    """A Qwen2-Audio checkpoint's `audio_tower.*` / `multi_modal_projector.linear.*` weights load into the tower."""
    import json

    from safetensors.torch import save_file

    from encoder_server.models.audio_loader import TINY_AUDIO_CONFIG, load_audio_model, random_audio_model

    src = random_audio_model(TINY_AUDIO_CONFIG, seed=7)
    state = {f"audio_tower.{k}": v for k, v in src.state_dict().items() if not k.startswith("proj.")}
    state |= {f"multi_modal_projector.linear.{k[5:]}": v for k, v in src.state_dict().items() if k.startswith("proj.")}
    state["language_model.lm_head.weight"] = torch.zeros(2, 2)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    cfg = {k: v for k, v in TINY_AUDIO_CONFIG.to_dict().items() if k != "out_hidden_size"}
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2_audio", "audio_config": cfg, "text_config": {"hidden_size": 256}})
    )
    loaded = load_audio_model(str(tmp_path))
    assert loaded is not None and loaded.model_id.startswith("audio:")
    feats = LogMel()(LogMel().windows(torch.randn(16000) * 0.1)[0])
    frames = torch.tensor([100])
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(feats, frames), src(feats, frames), rtol=0, atol=0)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mimo_v2_flash"}))
    assert load_audio_model(str(tmp_path)) is None
