"""MiMo's vision band attention kernel (Triton) against its torch twin, under TRITON_INTERPRET=1 on a CPU
(tests/conftest.py sets it): GQA, sinks on key 0, windows from none to wider than a segment, segments shorter than a
block and spanning several, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from encoder_server.kernels.band_attention import band_attention_triton
from encoder_server.models.mimo_vision import band_attention


@pytest.mark.parametrize("window", [0, 3, 16, 100])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (2, 2, 24)])
def test_kernel_equals_torch_twin(window, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(window + heads)
    lengths = [1, 7, 70, 33]
    s = sum(lengths)
    q = torch.randn(s, heads, dim, generator=g)
    k, v = (torch.randn(s, kv_heads, dim, generator=g) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for sinks in (None, torch.randn(heads, generator=g) * 2):
        got = band_attention_triton(q, k, v, cu, window, sinks, block=16)
        want = band_attention(
            q, k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1), cu, window, sinks
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_in_bf16_stays_close():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(50, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 20, 50])
    sinks = torch.randn(2, generator=g)
    got = band_attention_triton(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, 8, sinks.bfloat16(), block=16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), band_attention(q, k, v, cu, 8, sinks), rtol=3e-2, atol=3e-2)


def test_grouping_that_does_not_divide_is_refused():
    q, k = torch.zeros(4, 3, 16), torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="3 query heads over 2"):
        band_attention_triton(q, k, k, torch.tensor([0, 4]), 2, None)


def test_tower_through_the_kernel_equals_the_torch_path():
    from encoder_server.models import random_model
    from encoder_server.models.mimo_vision import MiMoVisionConfig, MiMoVisionTower
    from tests.encoder.test_mimo_vision import TINY

    torch_path = random_model(MiMoVisionConfig(**TINY), seed=4)
    kernel_path = MiMoVisionTower(MiMoVisionConfig(**TINY), kernel=True)
    kernel_path.load_state_dict(torch_path.state_dict())
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    pixels = torch.randn(40, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kernel_path(pixels, grid), torch_path(pixels, grid), rtol=1e-5, atol=1e-5)
