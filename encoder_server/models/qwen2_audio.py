"""The Qwen2-Audio audio tower (transformers' `Qwen2AudioEncoder` + `Qwen2AudioMultiModalProjector`).

Forward of one batch of 30-s windows `features [B, n_mels, 2 * max_source_positions]` with the valid mel
frames of each window `frames [B]`:

1. convolutional stem: `gelu(conv1(x))` (kernel 3, pad 1), `gelu(conv2(.))` (kernel 3, stride 2, pad 1),
   run on the whole padded window, as transformers does (the last valid frame's stride-2 conv reads the
   padding's features, so the stem must see them);
2. plus the learned position table; then only the first `L = max(conv_len)` positions are kept, where
   `conv_len = (frames - 1) // 2 + 1` (transformers' `_get_feat_extract_output_lengths`);
3. pre-norm transformer layers whose attention masks each window's keys beyond its `conv_len` (transformers
   masks the same keys; every other operation is per position, so the valid rows equal transformers' rows
   while the padded tail of a window is never computed);
4. average pooling over pairs of positions, the final LayerNorm, and the projector into the LLM's width;
5. each window keeps its first `(conv_len - 2) // 2 + 1` tokens (what Qwen2-Audio splices into the prompt).

The output is packed: `[sum(tokens), out_hidden_size]` in window order; `tokens_per_window(frames)` gives
the split. State-dict names are transformers' (`conv1`, `layers.N.self_attn.q_proj`, ...), the projector is
`proj` (`multi_modal_projector.linear` in a Qwen2-Audio checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AudioTowerConfig:
    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    scale_embedding: bool = False  # read from configs; transformers' forward does not apply it either
    out_hidden_size: int = 4096  # the LLM's hidden size (the projector's output)

    @property
    def window_frames(self) -> int:
        return self.max_source_positions * 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "AudioTowerConfig":
        """From a `qwen2_audio` config (its `audio_config` and `text_config.hidden_size`), a
        `qwen2_audio_encoder` config (projector width = `out_hidden_size` when given, else `d_model`), or a
        config that embeds one under `audio_config`."""
        audio = d.get("audio_config", d)
        text = d.get("text_config") or {}
        fields = {k: audio[k] for k in cls.__dataclass_fields__ if k in audio}
        fields["out_hidden_size"] = text.get("hidden_size", audio.get("out_hidden_size", audio.get("d_model", 1280)))
        return cls(**fields)


# Qwen2-Audio-7B's tower (Whisper-large-v3 encoder) and projector into its 4096-wide LLM.
QWEN2_AUDIO_7B_CONFIG = AudioTowerConfig()


def _act(name: str):
    acts = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
    try:
        return acts[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(acts)}") from None


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        if self.head_dim * heads != dim:
            raise ValueError(f"d_model {dim} is not divisible by {heads} heads")
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        # The query is scaled before the product, as transformers does (and the product is then unscaled).
        q, k, v = heads(self.q_proj(x) * self.scaling), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class _Layer(nn.Module):
    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = _Attention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _act(cfg.activation_function)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:
            big = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-big, big)
        return x


def conv_lengths(frames: torch.Tensor) -> torch.Tensor:
    return (frames - 1) // 2 + 1


def tokens_per_window(frames: torch.Tensor) -> torch.Tensor:
    """Tokens each window yields for its valid mel frames (transformers' `_get_feat_extract_output_lengths`)."""
    return (conv_lengths(frames) - 2) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table (the initial value of the learned table)."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2))
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class Qwen2AudioTower(nn.Module):
    def __init__(self, cfg: AudioTowerConfig):
        super().__init__()
        self.config = cfg
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.embed_positions.requires_grad_(False)
        with torch.no_grad():
            self.embed_positions.weight.copy_(sinusoids(cfg.max_source_positions, d))
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(cfg.encoder_layers)])
        self.layer_norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, cfg.out_hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.conv1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.conv1.weight.device

    def forward(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """`features [B, n_mels, window_frames]`, `frames [B]` -> packed `[sum(tokens), out_hidden_size]`."""
        cfg = self.config
        if features.shape[-1] != cfg.window_frames or features.shape[1] != cfg.num_mel_bins:
            raise ValueError(
                f"audio features must be [B, {cfg.num_mel_bins}, {cfg.window_frames}], got {list(features.shape)}"
            )
        frames = frames.to(torch.long).cpu()
        x = features.to(self.device, self.dtype)
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        x = x + self.embed_positions.weight
        lens = conv_lengths(frames)
        t = int(lens.max())
        x = x[:, :t]
        mask = None
        if int(lens.min()) < t:  # some window is shorter than the longest: mask its padded keys
            keep = torch.arange(t)[None, :] < lens[:, None]
            mask = keep[:, None, None, :].to(self.device)
        for layer in self.layers:
            x = layer(x, mask)
        x = F.avg_pool1d(x.permute(0, 2, 1), 2, 2).permute(0, 2, 1)
        x = self.proj(self.layer_norm(x))
        n = tokens_per_window(frames)
        keep = torch.arange(x.shape[1])[None, :] < n[:, None]
        return x[keep.to(self.device)]
