"""MiMo-V2.5's own ears: the MiMo-Audio tokenizer (waveform -> log-mel -> codes) and the audio encoder (codes ->
LLM embeddings), computed as vLLM's `MimoAudioEncoder` (vllm/model_executor/models/mimo_audio.py, the reference;
transformers has none).

1. **Log-mel** (`log_mel`, the processor's fixed settings): 24 kHz mono float32; |STFT| with n_fft 960, hop 240, a
   periodic Hann window of 960, centred with reflect padding; 128 HTK mel bands over 0-12 kHz without area
   normalisation; natural log of max(., 1e-7). [T, 128], 100 frames a second.
2. **Tokenizer** (`MiMoAudioTokenizer`, the checkpoint's `audio_tokenizer/` folder, run in bf16 as the reference runs
   it): an item is cut into segments of `audio_segment_size` mel frames; the segments of one encode call (at most
   256,000 frames, greedily) are zero-padded to the longest and run together through conv1 (k, pad 1) + GELU and
   conv2 (k, stride s, pad 1) + GELU, then per segment (varlen) through pre-LayerNorm transformer layers with rotary
   positions over the whole head (theta `rope_theta`, inverse frequencies rounded to bf16), causal or not, each layer
   windowed (left, right) or full (`hybrid_attention`: the last layer of each `swa_per_block` is full); the output
   of layer `encoder_skip_layer_id - 1` is added to the last one's, then a LayerNorm; with `avg_pooler` p != 1, a
   stride-p convolution + GELU + LayerNorm halves the rate (25 Hz); a residual vector quantiser (fp32, nearest by
   the expanded squared distance) turns each frame into `num_quantizers` codes.
   The padded batch is the reference's and it shows: a segment shorter than the call's longest, of odd length,
   has its last frames computed from the padding (conv2 reads conv1's output past the segment's end; the pooling
   pads a short segment by repeating its last frame and the longest one with zeros). Ours runs each item's
   segments as one call, exactly as the reference does for an item encoded alone, so an item's codes never depend
   on the other items of a batch (the reference's do, when several items share a call: a defect we do not copy).
3. **Encoder** (`MiMoAudioEncoder`, the main checkpoint's `speech_embeddings.*` and `audio_encoder.*`): the first
   `audio_channels` codes of each frame, padded to a multiple of `group_size` frames by repeating the last frame,
   in groups of `group_size`; each group's frames are the sum of one embedding per channel (in channel order);
   a Qwen2-style transformer runs inside each group (RMSNorm, q/k/v with biases, SiLU MLP, rotary theta
   `rope_theta` over the whole head, bidirectional unless `input_full_attention` is false), an optional final
   RMSNorm (`add_post_norm`); each group, flattened, is projected to the LLM's width (one linear, or linear-GELU-
   linear, no biases): one LLM token per group, ceil(ceil(T / 4) / 4) tokens for T mel frames.

Refused by field (`MiMoAudioConfigError`): what the reference does not compute, or computes so that the processor's
token count and the model's disagree (a kernel, stride or pooler other than 3 / 2 / 2, a group size other than 4, a
segment size not a multiple of 4), more channels than quantisers, an activation or norm type it does not have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from mimo_epd.layers import RMSNorm

SAMPLE_RATE = 24000
N_FFT = 960
HOP = 240
N_MELS = 128
MAX_CALL_FRAMES = 256_000  # mel frames per tokenizer call (the reference's grouping of segments)


class MiMoAudioConfigError(ValueError):
    """An audio config this file cannot compute exactly as the reference does (names the field)."""


def _known(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names and v is not None}


@dataclass
class MiMoAudioTokenizerConfig:
    """`audio_tokenizer/config.json`: the fields the encoder side reads (the decoder's and vocoder's are ignored)."""

    d_model: int = 768
    n_mels: int = 80
    kernel_size: int = 3
    stride_size: int = 2
    encoder_layers: int = 8
    encoder_attention_heads: int = 12
    encoder_ffn_dim: int = 3072
    activation_function: str = "gelu"
    encoder_causal: bool = False
    encoder_attn_window_size: list[int] = field(default_factory=lambda: [-1, -1])
    hybrid_attention: bool = False
    swa_per_block: int = 2
    encoder_skip_layer_id: int | None = None
    avg_pooler: int = 1
    num_quantizers: int = 12
    codebook_size: list[int] | int = field(default_factory=lambda: [1024])
    rope_theta: float = 10000.0
    rope_type: str = "default"
    ln_type: str = "LayerNorm"

    @classmethod
    def from_dict(cls, d: dict) -> "MiMoAudioTokenizerConfig":
        cfg = cls(**_known(cls, d))
        cfg.check()
        return cfg

    def check(self) -> None:
        def bad(name: str, why: str) -> MiMoAudioConfigError:
            return MiMoAudioConfigError(f"audio_tokenizer/config.json {name}: {why}")

        if (self.kernel_size, self.stride_size, self.avg_pooler) != (3, 2, 2):
            raise bad(
                "kernel_size / stride_size / avg_pooler",
                f"{self.kernel_size} / {self.stride_size} / {self.avg_pooler}: the processor counts an item's "
                "tokens for 3 / 2 / 2 and the model would disagree with it",
            )
        if self.n_mels != N_MELS:
            raise bad("n_mels", f"{self.n_mels}: the processor computes {N_MELS} mel bands")
        if self.activation_function != "gelu" or self.ln_type != "LayerNorm" or self.rope_type != "default":
            raise bad("activation_function / ln_type / rope_type", "only gelu / LayerNorm / default exist")
        if self.d_model % self.encoder_attention_heads or (self.d_model // self.encoder_attention_heads) % 2:
            raise bad("encoder_attention_heads", f"{self.encoder_attention_heads} heads over d_model {self.d_model}")
        if self.num_quantizers < 1:
            raise bad("num_quantizers", f"{self.num_quantizers}: the encoder needs codes")
        skip = self.encoder_skip_layer_id
        if skip is not None and not 1 <= skip <= self.encoder_layers:
            raise bad("encoder_skip_layer_id", f"{skip} outside 1..{self.encoder_layers}")

    @property
    def codebook_sizes(self) -> list[int]:
        sizes = list(self.codebook_size) if isinstance(self.codebook_size, list) else [int(self.codebook_size)]
        return (sizes + [sizes[-1]] * self.num_quantizers)[: self.num_quantizers]

    def window(self, layer: int) -> tuple[int, int]:
        """(left, right) keys a query may reach in `layer` (-1: unbounded)."""
        left, right = (int(v) for v in self.encoder_attn_window_size)
        if self.hybrid_attention and layer % self.swa_per_block == self.swa_per_block - 1:
            return -1, -1
        return left, right


@dataclass
class MiMoAudioConfig:
    """The main config's `audio_config` (MiMo-Audio's defaults where it is silent, as the reference's)."""

    speech_vocab_size: str | int = "1025-1025-129-129-129-129-129-129"
    group_size: int = 4
    audio_channels: int = 8
    input_local_layers: int = 6
    input_local_dim: int = 1024
    input_full_attention: bool = True
    input_local_attn_heads: int = 64
    input_local_intermediate_size: int = 4096
    out_hidden_size: int = 4096
    rope_theta: float = 640000.0
    projection_layers: int = 1
    add_post_norm: bool = False
    audio_segment_size: int = 6000

    @classmethod
    def from_dict(cls, d: dict) -> "MiMoAudioConfig":
        cfg = cls(**_known(cls, d))
        cfg.check()
        return cfg

    def check(self) -> None:
        def bad(name: str, why: str) -> MiMoAudioConfigError:
            return MiMoAudioConfigError(f"audio_config.{name}: {why}")

        if self.group_size != 4:
            raise bad("group_size", f"{self.group_size}: the processor counts tokens in groups of 4")
        if self.audio_segment_size <= 0 or self.audio_segment_size % 4:
            raise bad("audio_segment_size", f"{self.audio_segment_size}: must be a positive multiple of 4")
        if self.projection_layers not in (1, 2):
            raise bad("projection_layers", f"{self.projection_layers}: 1 or 2")
        if self.input_local_dim % self.input_local_attn_heads:
            raise bad("input_local_attn_heads", f"{self.input_local_attn_heads} over {self.input_local_dim}")
        if len(self.vocab_sizes) != self.audio_channels:
            raise bad("speech_vocab_size", f"{self.speech_vocab_size!r} for {self.audio_channels} channels")

    @property
    def vocab_sizes(self) -> list[int]:
        v = str(self.speech_vocab_size)
        return [int(x) for x in v.split("-")] if "-" in v else [int(v)] * self.audio_channels


# ---------------------------------------------------------------------------------------------------- log-mel


def mel_filters(device=None) -> torch.Tensor:
    """[N_FFT / 2 + 1, N_MELS] triangular HTK mel filters over 0 .. 12 kHz, no area normalisation (fp32)."""
    freqs = torch.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1, device=device)

    def mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    m = torch.linspace(mel(0.0), mel(SAMPLE_RATE // 2), N_MELS + 2, device=device)
    f = 700.0 * (10 ** (m / 2595.0) - 1.0)
    diff = f[1:] - f[:-1]
    slopes = f[None, :] - freqs[:, None]
    down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
    return torch.clamp(torch.minimum(down, up), min=0.0)


def log_mel(samples: torch.Tensor, block: int = 6000) -> torch.Tensor:
    """24 kHz mono float32 samples [N] (N > 480) -> log-mel [1 + N // 240, 128] (natural log, floor 1e-7).

    The signal is reflect-padded by n_fft / 2 once (what a centred STFT does at its two ends) and the frames are
    computed `block` at a time from the padded samples they cover, so an hour never holds its whole spectrogram
    (481 x 360,000 complex values, 1.4 GB): the same frames as one centred STFT."""
    if samples.dim() != 1 or samples.shape[0] <= N_FFT // 2:
        raise ValueError(f"audio of {samples.shape[-1]} samples: MiMo's features need more than {N_FFT // 2}")
    x = F.pad(samples.float()[None, None], (N_FFT // 2, N_FFT // 2), mode="reflect")[0, 0]
    frames = 1 + samples.shape[0] // HOP
    window = torch.hann_window(N_FFT, periodic=True, device=x.device)
    fb = mel_filters(x.device).T
    out = torch.empty(frames, N_MELS, device=x.device)
    for a in range(0, frames, block):
        b = min(frames, a + block)
        spec = torch.stft(
            x[a * HOP : (b - 1) * HOP + N_FFT],
            N_FFT,
            hop_length=HOP,
            win_length=N_FFT,
            window=window,
            center=False,
            normalized=False,
            onesided=True,
            return_complex=True,
        ).abs()
        out[a:b] = torch.log(torch.clamp(fb @ spec, min=1e-7)).T
    return out


def log_mel_span(samples: torch.Tensor, offset: int, total: int, a: int, b: int) -> torch.Tensor:
    """Frames [a, b) of `log_mel` of a `total`-sample signal, from `samples` = its samples [offset, offset + len).

    Frame f reads the reflect-padded signal's [f * 240, f * 240 + 960), i.e. the samples [f * 240 - 480,
    f * 240 + 480) where they exist and their reflection about sample 0 or sample total - 1 where the frame
    reaches past an end; `samples` must hold every sample those frames read. The same values as `log_mel` of the
    whole signal, so an item can be featurised a segment at a time (`MiMoAudioStream`)."""
    half = N_FFT // 2
    lo, hi = a * HOP - half, (b - 1) * HOP + half  # [lo, hi) of the padded signal, in signal coordinates
    need_lo, need_hi = max(lo, 0), min(hi, total)
    if lo < 0:
        need_hi = max(need_hi, min(total, 1 - lo))
    if hi > total:
        need_lo = min(need_lo, max(0, total - 1 - (hi - total)))
    if need_lo < offset or need_hi > offset + samples.shape[0]:
        raise ValueError(
            f"frames [{a}, {b}) need samples [{need_lo}, {need_hi}), given [{offset}, {offset + samples.shape[0]})"
        )
    x = samples.float()
    parts = []
    if lo < 0:  # reflect about sample 0: x[-i] = x[i]
        parts.append(x[1 - offset : 1 - lo - offset].flip(0))
    parts.append(x[max(lo, 0) - offset : min(hi, total) - offset])
    if hi > total:  # reflect about the last sample: x[total - 1 + i] = x[total - 1 - i]
        parts.append(x[total - 1 - (hi - total) - offset : total - 1 - offset].flip(0))
    padded = torch.cat(parts) if len(parts) > 1 else parts[0]
    spec = torch.stft(
        padded,
        N_FFT,
        hop_length=HOP,
        win_length=N_FFT,
        window=torch.hann_window(N_FFT, periodic=True, device=x.device),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    ).abs()
    return torch.log(torch.clamp(mel_filters(x.device).T @ spec, min=1e-7)).T


def num_codes(mel_frames: int, segment: int) -> int:
    """Code frames of an item of `mel_frames` (kernel 3, stride 2, pooler 2: ceil(L / 4) per segment)."""
    full, rest = divmod(mel_frames, segment)
    return full * math.ceil(segment / 4) + math.ceil(rest / 4)


def num_tokens(mel_frames: int, segment: int = 6000, group: int = 4) -> int:
    """LLM tokens of an item: one per group of `group` code frames."""
    return math.ceil(num_codes(mel_frames, segment) / group)


# ---------------------------------------------------------------------------------------------------- tokenizer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _masked_attention(q, k, v, causal: bool, left: int, right: int) -> torch.Tensor:
    """One segment: q, k, v [L, H, hd] -> [L, H, hd]; softmax in fp32 (as flash attention accumulates), the
    result in q's dtype. Query i reaches key j iff (not causal or j <= i) and within (left, right) (-1: no bound)."""
    n = q.shape[0]
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    allow = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        allow &= j <= i
    if left >= 0:
        allow &= j >= i - left
    if right >= 0:
        allow &= j <= i + right
    qf, kf, vf = (t.transpose(0, 1).float() for t in (q, k, v))
    scores = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    out = scores.masked_fill(~allow, float("-inf")).softmax(-1) @ vf
    return out.transpose(0, 1).to(q.dtype)


class _TokenizerLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d)
        self.self_attn.k_proj = nn.Linear(d, d, bias=False)
        self.self_attn.v_proj = nn.Linear(d, d)
        self.self_attn.out_proj = nn.Linear(d, d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h, segments, cos, sin, causal: bool, window: tuple[int, int]) -> torch.Tensor:
        a = self.self_attn
        y = self.self_attn_layer_norm(h)
        n, hd = h.shape[0], h.shape[1] // self.heads
        q, k, v = (p(y).view(n, self.heads, hd) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = torch.cat([_masked_attention(q[s:e], k[s:e], v[s:e], causal, *window) for s, e in segments])
        h = h + a.out_proj(out.reshape(n, -1))
        return h + self.fc2(F.gelu(self.fc1(self.final_layer_norm(h))))


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed", torch.zeros(size, dim))


class MiMoAudioTokenizer(nn.Module):
    """Log-mel -> codes [frames, num_quantizers]: the checkpoint's `audio_tokenizer/` encoder (names under
    `encoder.`, the decoder's ignored). Runs in `dtype` (bf16 by default: the reference's); the quantiser in fp32."""

    def __init__(self, cfg: MiMoAudioTokenizerConfig):
        super().__init__()
        cfg.check()
        self.config = cfg
        d = cfg.d_model
        enc = self.encoder = nn.Module()
        enc.conv1 = nn.Conv1d(cfg.n_mels, d, cfg.kernel_size, padding=1)
        enc.conv2 = nn.Conv1d(d, d, cfg.kernel_size, stride=cfg.stride_size, padding=1)
        enc.layers = nn.ModuleList(
            _TokenizerLayer(d, cfg.encoder_attention_heads, cfg.encoder_ffn_dim) for _ in range(cfg.encoder_layers)
        )
        enc.layer_norm = nn.LayerNorm(d)
        enc.down_sample_layer = nn.Sequential(nn.Conv1d(d, d, cfg.avg_pooler, stride=cfg.avg_pooler, bias=False))
        enc.down_sample_norm = nn.LayerNorm(d)
        enc.quantizer = nn.Module()
        enc.quantizer.vq = nn.Module()
        enc.quantizer.vq.layers = nn.ModuleList(nn.Module() for _ in range(cfg.num_quantizers))
        for layer, size in zip(enc.quantizer.vq.layers, cfg.codebook_sizes):
            layer._codebook = _Codebook(size, d)
        hd = d // cfg.encoder_attention_heads
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv1.weight.dtype

    def _stem(self, mels: list[torch.Tensor], pad_to: int = 0) -> tuple[torch.Tensor, list[int]]:
        """The segments of one call, zero-padded together (to the longest, or `pad_to` frames) through the two
        convolutions: packed [sum T_b, d]."""
        enc, lengths = self.encoder, [m.shape[0] for m in mels]
        x = torch.zeros(len(mels), max(*lengths, pad_to), mels[0].shape[1], dtype=self.dtype, device=mels[0].device)
        for b, m in enumerate(mels):
            x[b, : m.shape[0]] = m.to(self.dtype)
        h = F.gelu(enc.conv1(x.transpose(1, 2)))
        h = F.gelu(enc.conv2(h)).transpose(1, 2)
        valid = [(n + 1) // 2 for n in lengths]  # ((L + 3 - 3) + 2 - 3) // 2 + 1
        return torch.cat([h[b, :t] for b, t in enumerate(valid)]), valid

    def _pool(self, h: torch.Tensor, valid: list[int], pad_to: int = 0) -> torch.Tensor:
        """Unpacked with each short segment's last frame repeated, the longest padded with zeros to the pooler
        (the longest: of the call's segments, or of `pad_to` mel frames)."""
        p, tmax = self.config.avg_pooler, max(*valid, (pad_to + 1) // 2)
        rows, start = [], 0
        for t in valid:
            seg = h[start : start + t]
            rows.append(torch.cat([seg, seg[-1:].expand(tmax - t, -1)]) if t < tmax else seg)
            start += t
        x = torch.stack(rows)
        if tmax % p:
            x = F.pad(x, (0, 0, 0, p - tmax % p))
        pooled = F.gelu(self.encoder.down_sample_layer(x.transpose(1, 2))).transpose(1, 2)
        out = torch.cat([pooled[b, : (t + p - 1) // p] for b, t in enumerate(valid)])
        return self.encoder.down_sample_norm(out)

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        r, codes = x.float(), []
        for layer in self.encoder.quantizer.vq.layers:
            e = layer._codebook.embed.float()
            score = -(r.pow(2).sum(-1, keepdim=True) - 2 * r @ e.T + e.pow(2).sum(-1)[None, :])
            idx = score.argmax(-1)
            codes.append(idx)
            r = r - e[idx]
        return torch.stack(codes, dim=-1)

    def _call(self, mels: list[torch.Tensor], pad_to: int = 0) -> torch.Tensor:
        cfg, enc = self.config, self.encoder
        h, valid = self._stem(mels, pad_to)
        bounds = torch.tensor([0, *valid]).cumsum(0).tolist()
        segments = list(zip(bounds[:-1], bounds[1:]))
        positions = torch.cat([torch.arange(t, device=h.device) for t in valid])
        inv = self.inv_freq.to(self.dtype)  # the reference's buffer is cast with the module: bf16-rounded
        cos, sin = _rotary(positions, inv, self.dtype)
        skip = None
        for i, layer in enumerate(enc.layers):
            h = layer(h, segments, cos, sin, cfg.encoder_causal, cfg.window(i))
            if cfg.encoder_skip_layer_id is not None and i == cfg.encoder_skip_layer_id - 1:
                skip = h
        if skip is not None:
            h = h + skip
        return self._quantize(self._pool(enc.layer_norm(h), valid, pad_to))

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, segment: int) -> torch.Tensor:
        """One item's log-mel [T, n_mels] -> codes [num_codes(T), num_quantizers] (int64): segments of `segment`
        frames, grouped into calls of at most MAX_CALL_FRAMES frames as the reference groups them."""
        n = mel.shape[0]
        cuts = [(a, min(n, a + segment)) for a in range(0, n, segment)]
        calls = call_groups([b - a for a, b in cuts])
        return torch.cat([self._call([mel[cuts[i][0] : cuts[i][1]] for i in call]) for call in calls])

    @torch.inference_mode()
    def segment_codes(self, mel: torch.Tensor, pad_to: int = 0) -> torch.Tensor:
        """One segment's codes as its call computes them: padded with its call's longest segment (`pad_to` mel
        frames; `call_longest` says how long) and otherwise on its own (a call's segments never mix)."""
        return self._call([mel], pad_to)


def call_groups(lengths: list[int]) -> list[list[int]]:
    """The reference's grouping of an item's segments (their mel lengths, in order) into tokenizer calls: greedily,
    at most MAX_CALL_FRAMES frames a call (a segment longer than that alone)."""
    calls: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(lengths):
        if calls[-1] and size + n > MAX_CALL_FRAMES:
            calls.append([])
            size = 0
        calls[-1].append(i)
        size += n
    return calls


def call_longest(lengths: list[int], i: int) -> int:
    """The longest segment of the call segment i is in (what its zero padding reaches)."""
    return next(max(lengths[j] for j in call) for call in call_groups(lengths) if i in call)


# ---------------------------------------------------------------------------------------------------- encoder


class _LocalLayer(nn.Module):
    def __init__(self, d: int, heads: int, inter: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d), RMSNorm(d)
        self.self_attn = nn.Module()
        self.self_attn.q_proj, self.self_attn.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.self_attn.v_proj, self.self_attn.o_proj = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(d, inter, bias=False), nn.Linear(d, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor, cos, sin, causal: bool) -> torch.Tensor:
        a, (n, g, d) = self.self_attn, x.shape
        y = self.input_layernorm(x)
        q, k, v = (p(y).view(n, g, self.heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + a.o_proj(o.transpose(1, 2).reshape(n, g, d))
        y = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))


class MiMoAudioEncoder(nn.Module):
    """Codes [frames, >= audio_channels] -> LLM embeddings [ceil(frames / group_size), out_hidden_size]. Names as
    the checkpoint stores them with `audio_encoder.` removed (`speech_embeddings.{c}` keep theirs)."""

    def __init__(self, cfg: MiMoAudioConfig):
        super().__init__()
        cfg.check()
        self.config = cfg
        d, g = cfg.input_local_dim, cfg.group_size
        self.speech_embeddings = nn.ModuleList(nn.Embedding(v, d) for v in cfg.vocab_sizes)
        self.input_local_transformer = nn.Module()
        self.input_local_transformer.layers = nn.ModuleList(
            _LocalLayer(d, cfg.input_local_attn_heads, cfg.input_local_intermediate_size)
            for _ in range(cfg.input_local_layers)
        )
        self.input_local_transformer.norm = RMSNorm(d)
        if cfg.projection_layers == 1:
            self.projection: nn.Module = nn.Linear(d * g, cfg.out_hidden_size, bias=False)
        else:
            self.projection = nn.Module()
            self.projection.mlp = nn.Sequential(
                nn.Linear(d * g, 4 * d * g, bias=False),
                nn.GELU(),
                nn.Linear(4 * d * g, cfg.out_hidden_size, bias=False),
            )

    def _inv_freq(self, device) -> torch.Tensor:
        """fp32 whatever the module's dtype (the reference's local transformer keeps its rotary in fp32)."""
        hd = self.config.input_local_dim // self.config.input_local_attn_heads
        return 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=device) / hd))

    @torch.inference_mode()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        g, c = cfg.group_size, cfg.audio_channels
        if codes.shape[0] == 0 or codes.shape[1] < c:
            raise ValueError(f"codes {tuple(codes.shape)}: need at least one frame of {c} channels")
        codes = codes[:, :c]
        pad = -codes.shape[0] % g
        if pad:
            codes = torch.cat([codes, codes[-1:].expand(pad, -1)])
        groups = codes.view(-1, g, c)
        dtype = self.speech_embeddings[0].weight.dtype
        x = torch.zeros(groups.shape[0], g, cfg.input_local_dim, dtype=dtype, device=codes.device)
        for ch, emb in enumerate(self.speech_embeddings):
            x = x + emb(groups[..., ch])
        cos, sin = _rotary(torch.arange(g, device=x.device), self._inv_freq(x.device), dtype)
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)  # [1, g, hd]: broadcast over groups and heads
        for layer in self.input_local_transformer.layers:
            x = layer(x, cos, sin, not cfg.input_full_attention)
        if cfg.add_post_norm:
            x = self.input_local_transformer.norm(x)
        z = x.reshape(x.shape[0], -1)
        return self.projection(z) if cfg.projection_layers == 1 else self.projection.mlp(z)


@dataclass
class MiMoAudioModel:
    """The two halves, as one checkpoint holds them: waveform (24 kHz) -> codes -> embeddings."""

    tokenizer: MiMoAudioTokenizer
    encoder: MiMoAudioEncoder

    def codes(self, samples: torch.Tensor) -> torch.Tensor:
        return self.tokenizer(log_mel(samples), self.encoder.config.audio_segment_size)

    def embed(self, samples: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.codes(samples))

    @torch.inference_mode()
    def rows_from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """An item's rows from its codes (a cached codes entry): the encoder over a segment's codes at a time, as the
        stream runs it (each segment's codes are whole groups, and a group's rows depend on that group only), so
        the rows equal the stream's and memory holds one segment's work whatever the item's length."""
        step = num_codes(self.encoder.config.audio_segment_size, self.encoder.config.audio_segment_size)
        codes = codes.long()
        return torch.cat([self.encoder(codes[a : a + step]) for a in range(0, codes.shape[0], step)])


class MiMoAudioStream:
    """One item's embedding rows a segment at a time, equal to `MiMoAudioModel.embed` of the whole item.

    Samples are pushed in order (`push`) and each segment of `audio_segment_size` mel frames is computed as soon as
    the samples its frames read are in (its 480-sample right context, and enough to know it is not the last): its
    log-mel from those samples (`log_mel_span`), its codes as its tokenizer call would (a full segment is its call's
    longest), its rows (a segment's codes are whole groups). `finish` computes what is left at the end: the last
    segments, the short one padded to its call's longest (`call_longest`), the encoder's group padding. Memory: one
    segment's samples and features, whatever the item's length (an hour at 24 kHz is 345 MB whole)."""

    def __init__(self, model: MiMoAudioModel):
        self.model = model
        self.segment = model.encoder.config.audio_segment_size
        self.buf = torch.empty(0)
        self.offset = 0  # buf holds the signal's samples [offset, offset + len(buf))
        self.done = 0  # segments computed
        self.codes: list[torch.Tensor] = []  # each segment's codes, in order (the item's, cached beside its rows)

    @property
    def seen(self) -> int:
        return self.offset + self.buf.shape[0]

    @torch.inference_mode()
    def push(self, samples: torch.Tensor) -> list[torch.Tensor]:
        """The next samples in; the rows of each segment they complete out (in order)."""
        self.buf = torch.cat([self.buf, samples.float()]) if self.buf.numel() else samples.float()
        out = []
        while self.seen >= (self.done + 1) * self.segment * HOP + HOP:  # its frames' samples, and a frame after it
            a = self.done * self.segment
            out.append(self._rows(a, a + self.segment, self.seen, 0))
        return out

    @torch.inference_mode()
    def finish(self) -> list[torch.Tensor]:
        """The rows of the segments left once every sample is in."""
        total = self.seen
        if total <= N_FFT // 2:
            raise ValueError(f"audio of {total} samples: MiMo's features need more than {N_FFT // 2}")
        frames = 1 + total // HOP
        cuts = [(a, min(frames, a + self.segment)) for a in range(self.done * self.segment, frames, self.segment)]
        first, lengths = self.done, [self.segment] * self.done + [b - a for a, b in cuts]
        codes = [self._codes(a, b, total, call_longest(lengths, first + i)) for i, (a, b) in enumerate(cuts)]
        return [self.model.encoder(torch.cat(codes))] if codes else []

    def _codes(self, a: int, b: int, total: int, pad_to: int) -> torch.Tensor:
        mel = log_mel_span(self.buf, self.offset, total, a, b)
        codes = self.model.tokenizer.segment_codes(mel, pad_to if pad_to > b - a else 0)
        # the next segment reads from its first frame's context, and one sample more where it reflects at the end
        keep = max(0, b * HOP - N_FFT // 2 - 1 - self.offset)
        self.buf, self.offset = self.buf[keep:], self.offset + keep
        self.done += 1
        self.codes.append(codes)
        return codes

    def _rows(self, a: int, b: int, total: int, pad_to: int) -> torch.Tensor:
        return self.model.encoder(self._codes(a, b, total, pad_to))


def is_mimo_audio_config(audio_config: dict) -> bool:
    """MiMo's `audio_config` (no model_type; MiMo-Audio's keys), not Qwen2-Audio's (`qwen2_audio_encoder`)."""
    return isinstance(audio_config, dict) and ("speech_vocab_size" in audio_config or "audio_channels" in audio_config)


def load_mimo_audio(directory: str, dtype: torch.dtype = torch.float32, device="cpu") -> MiMoAudioModel:
    """A MiMo checkpoint's audio path: the tokenizer from `audio_tokenizer/` (run in bf16, the reference's dtype),
    the encoder from the main files' `speech_embeddings.*` / `audio_encoder.*` (in `dtype`). Only those tensors are
    read. A missing tensor is refused by name."""
    import json
    import os

    from safetensors import safe_open

    cfg = json.load(open(os.path.join(directory, "config.json")))
    folder = os.path.join(directory, "audio_tokenizer")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise FileNotFoundError(f"{folder}/model.safetensors: MiMo's audio tokenizer is missing")
    tokenizer = MiMoAudioTokenizer(
        MiMoAudioTokenizerConfig.from_dict(json.load(open(os.path.join(folder, "config.json"))))
    )
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as fh:
        state = {n: fh.get_tensor(n) for n in fh.keys() if n.startswith("encoder.")}
    _load(tokenizer, state, f"{folder}/model.safetensors")
    encoder = MiMoAudioEncoder(MiMoAudioConfig.from_dict(cfg["audio_config"]))
    if encoder.config.audio_channels > tokenizer.config.num_quantizers:
        raise MiMoAudioConfigError(
            f"audio_config.audio_channels: {encoder.config.audio_channels} > the tokenizer's "
            f"{tokenizer.config.num_quantizers} quantizers"
        )
    state = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), framework="pt") as fh:
                for n in fh.keys():
                    if n.startswith("speech_embeddings."):
                        state[n] = fh.get_tensor(n)
                    elif n.startswith("audio_encoder."):
                        state[n.removeprefix("audio_encoder.")] = fh.get_tensor(n)
    _load(encoder, state, f"{directory} (speech_embeddings.*, audio_encoder.*)")
    tokenizer.to(device=device, dtype=torch.bfloat16).eval()  # codebooks too: bf16-rounded, fp32 in `_quantize`
    encoder.to(device=device, dtype=dtype).eval()
    return MiMoAudioModel(tokenizer, encoder)


def _load(module: nn.Module, state: dict, where: str) -> None:
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    if missing:
        raise ValueError(f"{where}: lacks {len(missing)} tensors the audio path needs, e.g. {missing[:4]}")
    bad = [k for k in own if tuple(state[k].shape) != tuple(own[k].shape)]
    if bad:
        raise ValueError(f"{where}: {bad[0]} is {tuple(state[bad[0]].shape)}, expected {tuple(own[bad[0]].shape)}")
    module.load_state_dict({k: state[k].to(own[k].dtype) for k in own})
