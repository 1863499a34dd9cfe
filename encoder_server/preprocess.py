"""Image preprocessing in the Qwen2-VL processor convention (transformers `Qwen2VLImageProcessor`), and in MiMo-V2.5's
(`processor="mimo"`, the reference being vLLM's `MiMoVLProcessor`; see the end of this docstring).

`preprocess_images(images, config, device)` returns `(pixel_values [num_patches, C*T*P*P], grid_thw [n, 3])`
exactly in the order and layout of transformers' `Qwen2VLImageProcessor`:

1. `smart_resize` picks a target size divisible by `patch_size * merge_size` within the pixel bounds;
2. resize, bicubic with antialiasing: on the device with torchvision (what the fast HF processor does;
   images sharing a source and target size are resized as one batch), or with PIL on the CPU
   (pillow-simd when installed; what the slow HF processor does);
3. rescale by 1/255 and normalize with the CLIP mean/std (fused into one affine map per channel);
4. patchify: a still image becomes `temporal_patch_size` identical frames; patches are ordered
   merge-block-major so that each `merge x merge` group the vision merger folds is contiguous.

MiMo's processor differs in three places, all followed exactly when `PreprocessConfig.processor == "mimo"`:
its `smart_resize` first scales an image whose short side is under the factor up to the factor (`mimo_smart_resize`);
it resizes the pixels as floats, bilinear without antialiasing (torch `interpolate`, align_corners=False), and never
rounds them back to uint8; it normalizes with the ImageNet mean/std. So a MiMo image is always resized by torch,
in the server process (never by PIL in a decode process), and never from a JPEG draft (the reference decodes the
whole image; a draft's pixels differ).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (123.675 / 255, 116.28 / 255, 103.53 / 255)  # MiMo's processor: (x - 255 m) / (255 s)
IMAGENET_STD = (58.395 / 255, 57.12 / 255, 57.375 / 255)
PROCESSORS = ("qwen2_vl", "mimo")
MAX_ASPECT_RATIO = 200


class ImageSizeError(ValueError):
    """The image cannot be resized under the processor's rules (too small, or too elongated)."""


@dataclass(frozen=True)
class PreprocessConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    processor: str = "qwen2_vl"  # whose resize rules: qwen2_vl (bicubic to uint8) or mimo (bilinear floats)

    def __post_init__(self):
        if self.processor not in PROCESSORS:
            raise ValueError(f"preprocessing processor {self.processor!r}: one of {PROCESSORS}")

    @property
    def exact_floats(self) -> bool:
        """Pixels are resized as floats by torch (MiMo): no uint8 patches, no PIL, no JPEG draft."""
        return self.processor == "mimo"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def preset(cls, name: str) -> "PreprocessConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preprocessing preset {name!r}; known: {sorted(PRESETS)}") from None

    @classmethod
    def from_hf_dict(cls, d: dict, base: "PreprocessConfig | None" = None) -> "PreprocessConfig":
        """From a `preprocessor_config.json` (either the `min_pixels`/`max_pixels` or the `size` spelling)."""
        base = base or cls()
        size = d.get("size") or {}
        return cls(
            patch_size=d.get("patch_size", base.patch_size),
            merge_size=d.get("merge_size", base.merge_size),
            temporal_patch_size=d.get("temporal_patch_size", base.temporal_patch_size),
            min_pixels=d.get("min_pixels", size.get("shortest_edge", base.min_pixels)),
            max_pixels=d.get("max_pixels", size.get("longest_edge", base.max_pixels)),
            mean=tuple(d.get("image_mean", base.mean)),
            std=tuple(d.get("image_std", base.std)),
            processor=d.get("processor", base.processor),
        )

    @classmethod
    def mimo(cls, vision: dict, processor_config: dict | None = None) -> "PreprocessConfig":
        """A MiMo checkpoint's: its vision_config's geometry and its config's `processor_config` pixel bounds, with
        the MiMo processor's defaults (4 and 4096 merged tokens' worth of pixels) where it has none."""
        pc = processor_config or {}
        patch, merge = int(vision.get("patch_size", 16)), int(vision.get("spatial_merge_size", 2))
        unit = patch * merge
        return cls(
            patch_size=patch,
            merge_size=merge,
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            min_pixels=int(pc.get("image_min_pixels") or 4 * unit * unit),
            max_pixels=int(pc.get("image_max_pixels") or 4096 * unit * unit),
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            processor="mimo",
        )

    def fingerprint(self) -> str:
        """A stable string of every field; part of content keys."""
        return ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))


PRESETS = {
    "qwen2_5_vl": PreprocessConfig(),
    "mimo_v2_5": PreprocessConfig.mimo({}),
    # Qwen2-VL's rules at patch 16: a Qwen-architecture tower built with MiMo's patch size (tests, benchmarks)
    "qwen2_vl_patch16": PreprocessConfig(patch_size=16, min_pixels=3136, max_pixels=12845056),
}


def preset_for_tower(patch_size: int) -> PreprocessConfig:
    """A Qwen-architecture tower's preprocessing when its checkpoint names none: Qwen2-VL's rules at its patch."""
    return PRESETS["qwen2_vl_patch16" if patch_size == 16 else "qwen2_5_vl"]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): divisible by `factor`, pixel count within bounds, aspect kept.

    The rules of transformers' `smart_resize` (qwen2_vl), the reference: only an aspect ratio over 200 is
    refused; an image smaller than `factor` (even 1x1) rounds to nothing and is scaled up to `min_pixels`."""
    if height <= 0 or width <= 0:
        raise ImageSizeError(f"image has an empty size {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(f"image is {width}x{height}; aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar <= 0 or w_bar <= 0:  # only with min_pixels <= 0: the reference would go on to fail in its resize
        raise ImageSizeError(f"image is {width}x{height}; it resizes to nothing with min_pixels={min_pixels}")
    return h_bar, w_bar


def mimo_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """MiMo's processor's rules: as `smart_resize`, except that an image whose short side is under `factor` is
    first scaled (aspect kept, the long side truncated) to a short side of `factor`, and that a size the bounds
    round to nothing is refused rather than floored at `factor`."""
    if height <= 0 or width <= 0:
        raise ImageSizeError(f"image has an empty size {width}x{height}")
    h, w = height, width
    if min(h, w) < factor:
        h, w = (factor, int(w * factor / h)) if h < w else (int(h * factor / w), factor)
    elif max(h, w) / min(h, w) > MAX_ASPECT_RATIO:
        raise ImageSizeError(f"image is {width}x{height}; aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar, w_bar = round(h / factor) * factor, round(w / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((h * w) / max_pixels)
        h_bar, w_bar = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        h_bar, w_bar = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    if h_bar <= 0 or w_bar <= 0:
        raise ImageSizeError(f"image is {width}x{height}; MiMo's resize rules give it an empty size")
    return int(h_bar), int(w_bar)


def target_size(height: int, width: int, config: PreprocessConfig) -> tuple[int, int]:
    rule = mimo_smart_resize if config.processor == "mimo" else smart_resize
    return rule(height, width, config.factor, config.min_pixels, config.max_pixels)


def grid_for(height: int, width: int, config: PreprocessConfig, frames: int = 1) -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image (or a clip of `frames` frames) after resizing."""
    th, tw = target_size(height, width, config)
    t = math.ceil(frames / config.temporal_patch_size)
    return t, th // config.patch_size, tw // config.patch_size


# ---------------------------------------------------------------------------------------------
# Resize
# ---------------------------------------------------------------------------------------------


def pillow_simd_active() -> bool:
    from importlib import metadata

    try:
        metadata.version("pillow-simd")
        return True
    except metadata.PackageNotFoundError:
        return False


def pil_image(image: np.ndarray):
    """HxWx3 uint8, or contiguous HxWx4 RGBX (`decode_image(..., rgbx=True)`) -> a PIL RGB-family image.

    PIL stores RGB with four bytes per pixel, so RGBX input is wrapped without a copy; HxWx3 input is
    copied in (for a 1080p image that copy and its allocation cost about as much as a quarter of the
    resize). Both resize to the same RGB values."""
    from PIL import Image

    if image.ndim == 3 and image.shape[2] == 4 and image.flags.c_contiguous:
        return Image.frombuffer("RGBX", (image.shape[1], image.shape[0]), image, "raw", "RGBX", 0, 1)
    return Image.fromarray(np.ascontiguousarray(image[..., :3]))


def resize_pil_hwc(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """HxWx3 (or RGBX) uint8 -> H'xW'x3 uint8 (a view) with PIL's antialiased bicubic (pillow-simd when installed)."""
    from PIL import Image

    h, w = size
    return np.asarray(pil_image(image).resize((w, h), resample=Image.Resampling.BICUBIC))[..., :3]


def resize_pil(image: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """HxWx3 uint8 -> 3xH'xW' uint8 with PIL's antialiased bicubic (pillow-simd when installed)."""
    # PIL hands its pixels to numpy read-only (they live in a bytes object), and torch warns on read-only
    # memory: copy only when the array is not already a fresh writable one (the RGBX path's slice copies anyway).
    return torch.from_numpy(np.require(resize_pil_hwc(image, size), requirements=["C", "W"])).permute(2, 0, 1)


def resize_bilinear_floats(batch: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[N, 3, H, W] uint8 (0..255) on any device -> [N, 3, H', W'] float32, bilinear without antialiasing and
    without rounding: MiMo's processor's resize."""
    import torch.nn.functional as F

    return F.interpolate(batch.float(), list(size), mode="bilinear", align_corners=False)


def resize_torch(batch: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[N, 3, H, W] uint8 on any device -> [N, 3, H', W'] uint8, bicubic with antialiasing (torchvision)."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    return TF.resize(batch, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)


# ---------------------------------------------------------------------------------------------
# Normalize + patchify
# ---------------------------------------------------------------------------------------------


def normalize_patchify(
    resized: torch.Tensor, config: PreprocessConfig, out_dtype: torch.dtype = torch.float32, fold_time: bool = False
) -> torch.Tensor:
    """Torch reference: [N, 3, H, W] uint8 (already resized) -> [N * gh * gw, 3*T*P*P] normalized patches.

    Rescale and normalize are fused as transformers does: (x - 255*mean) / (255*std) in fp32. `resized` may also be
    float32 pixels in 0..255 (MiMo's unrounded resize).
    fold_time: emit each still image once ([.., 3*P*P]) instead of T identical frames; the vision
    tower folds its temporal kernel to match (see PatchEmbed).
    """
    n, c, h, w = resized.shape
    p, m, tp = config.patch_size, config.merge_size, 1 if fold_time else config.temporal_patch_size
    dev = resized.device
    gh, gw = h // p, w // p
    # Reorder the uint8 pixels first (1 byte per value), then normalise the contiguous result in place:
    # the same fp32 arithmetic per element as normalising first, a third of the memory traffic.
    x = resized.reshape(n, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.reshape(n * gh * gw, c, 1, p * p).to(torch.float32)
    mean = torch.tensor(config.mean, dtype=torch.float32, device=dev).view(1, c, 1, 1) * 255.0
    std = torch.tensor(config.std, dtype=torch.float32, device=dev).view(1, c, 1, 1) * 255.0
    x.sub_(mean).div_(std)
    # A still image repeats along the temporal patch axis.
    return x.expand(-1, -1, tp, -1).reshape(n * gh * gw, c * tp * p * p).to(out_dtype)


def patchify_uint8(image: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    """A resized HxWx3 uint8 image -> its still-image patches [gh*gw, 3*P*P] uint8, in the same order and
    layout as `normalize_patchify(..., fold_time=True)` but not normalised: the vision tower applies
    rescale + normalize inside its patch embedding (`PatchEmbed.set_input_normalization`). Runs in
    the decode processes on a CPU deployment, so the server process receives ready patches."""
    h, w, c = image.shape
    p, m = config.patch_size, config.merge_size
    gh, gw = h // p, w // p
    x = image.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(x).reshape(gh * gw, c * p * p)


def patchify_frames(
    frames: torch.Tensor, config: PreprocessConfig, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Normalized frames [T, 3, H, W] float -> patches [gt*gh*gw, 3*T'*P*P] (T padded with its last frame)."""
    t, c, h, w = frames.shape
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    if t % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - t % tp, -1, -1, -1)])
        t = frames.shape[0]
    gt, gh, gw = t // tp, h // p, w // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * p * p).to(out_dtype)


def _fused_kernel_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from .kernels import patchify_triton  # noqa: F401
    except Exception:  # pragma: no cover - Triton missing on this build
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

ImageLike = "np.ndarray | torch.Tensor"


def _as_hwc_uint8(image, index: int) -> np.ndarray | torch.Tensor:
    if isinstance(image, np.ndarray):
        arr = image
    elif isinstance(image, torch.Tensor):
        arr = image
    else:
        raise TypeError(f"image {index}: expected a numpy array or a torch tensor, got {type(image).__name__}")
    if arr.ndim == 2:  # grayscale
        arr = arr[..., None]
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3):
        raise ValueError(f"image {index}: expected HxWx3 (or HxW / HxWx1 grayscale), got shape {tuple(arr.shape)}")
    if arr.dtype not in (np.uint8, torch.uint8):
        raise ValueError(f"image {index}: expected uint8 pixels, got {arr.dtype}")
    if arr.shape[-1] == 1:
        arr = arr.repeat(3, -1) if isinstance(arr, np.ndarray) else arr.expand(-1, -1, 3)
    return arr


def _to_tensor(arr) -> torch.Tensor:
    if isinstance(arr, torch.Tensor):
        return arr
    if not arr.flags.writeable:  # torch wants writable memory; a read-only view (e.g. shared memory) is copied
        arr = arr.copy()
    return torch.from_numpy(arr)


def preprocess_images(
    images: Sequence,
    config: PreprocessConfig | str = "qwen2_5_vl",
    device=None,
    out_dtype: torch.dtype = torch.float32,
    resize_backend: str = "auto",
    source_sizes: Sequence[tuple[int, int]] | None = None,
    fold_time: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (HxWx3 uint8 numpy arrays or tensors) -> (pixel_values, grid_thw), like the HF processor.

    resize_backend: "torch" (torchvision on `device`, batched per shape), "pil" (PIL on the CPU,
    pillow-simd when installed), or "auto" (pil on a CPU when pillow-simd is installed, else torch).
    source_sizes: the (h, w) each image had before it was decoded at a reduced scale (JPEG draft) or
    already resized; the target size is computed from it, as the reference would from the full image.
    fold_time: patches of width 3*P*P (each still image once) instead of the HF layout's 3*T*P*P;
    only for the vision tower in this package, which folds its temporal kernel to match.
    """
    if isinstance(config, str):
        config = PreprocessConfig.preset(config)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if resize_backend == "auto":
        resize_backend = "pil" if device.type == "cpu" and pillow_simd_active() else "torch"
    if resize_backend not in ("torch", "pil"):
        raise ValueError(f"resize_backend must be auto, torch or pil, got {resize_backend!r}")

    arrays = [_as_hwc_uint8(img, i) for i, img in enumerate(images)]
    targets = []
    for i, arr in enumerate(arrays):
        h, w = source_sizes[i] if source_sizes is not None else (int(arr.shape[0]), int(arr.shape[1]))
        try:
            targets.append(target_size(h, w, config))
        except ImageSizeError as e:
            raise ImageSizeError(f"image {i}: {e}") from None

    # Resize, batching the images that share a source and a target size.
    resized: list[torch.Tensor | None] = [None] * len(arrays)
    if config.exact_floats:
        for i, (arr, size) in enumerate(zip(arrays, targets)):
            batch = _to_tensor(arr).to(device).permute(2, 0, 1)[None]
            resized[i] = resize_bilinear_floats(batch, size)[0]
    elif resize_backend == "pil":
        for i, (arr, size) in enumerate(zip(arrays, targets)):
            a = arr.cpu().numpy() if isinstance(arr, torch.Tensor) else arr
            resized[i] = resize_pil(np.ascontiguousarray(a), size).to(device)
    else:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (arr, size) in enumerate(zip(arrays, targets)):
            groups[(tuple(arr.shape), size)].append(i)
        for (_, size), idxs in groups.items():
            batch = torch.stack([_to_tensor(arrays[i]).to(device).permute(2, 0, 1) for i in idxs])
            same = batch.shape[-2:] == torch.Size(size)
            out = batch if same else resize_torch(batch, size)
            for j, i in enumerate(idxs):
                resized[i] = out[j]

    use_kernel = _fused_kernel_available(device)  # uint8 pixels, or MiMo's float ones
    patches = []
    for img in resized:
        batch = img.unsqueeze(0).contiguous()
        if use_kernel:
            from .kernels import patchify_triton

            patches.append(patchify_triton(batch, config, out_dtype, fold_time=fold_time))
        else:
            patches.append(normalize_patchify(batch, config, out_dtype, fold_time=fold_time))
    grid = torch.tensor([[1, h // config.patch_size, w // config.patch_size] for h, w in targets], dtype=torch.long)
    return torch.cat(patches), grid
