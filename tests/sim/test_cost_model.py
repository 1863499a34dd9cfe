"""The cost model: monotonic in what a step computes, SWA context capped at the window, the fit recovers a model."""

import pytest

from llm_backend.sim.cost import CostModel, RooflineProfile, fit_linear, load_profile, step_features
from llm_backend.sim.shapes import get_shape


@pytest.fixture(params=["h200", "cpu-measured"])
def cost(request):
    shape = get_shape("pro" if request.param == "h200" else "tiny")
    return CostModel(shape, load_profile(request.param, 16))


def test_more_prefill_tokens_take_longer(cost):
    times = [cost.step_seconds([(0, n, True)]) for n in (1, 64, 512, 4096, 16384)]
    assert times == sorted(times) and times[-1] > times[0]


def test_longer_context_takes_longer(cost):
    times = [cost.step_seconds([(ctx, 256, True)]) for ctx in (0, 1000, 10_000, 100_000, 1_000_000)]
    assert times == sorted(times) and times[-1] > times[0]


def test_more_decode_sequences_take_longer(cost):
    times = [cost.step_seconds([(5000, 1, True)] * b) for b in (1, 2, 8, 32, 128)]
    assert times == sorted(times) and times[-1] > times[0]


def test_swa_context_is_capped_at_the_window():
    shape = get_shape("pro")
    near, far = step_features(shape, [(10_000, 1, True)]), step_features(shape, [(1_000_000, 1, True)])
    assert near.attn_swa_flops == far.attn_swa_flops  # a sliding layer sees window + 1 keys either way
    assert far.attn_full_flops > 50 * near.attn_full_flops  # a full layer sees the whole context
    short = step_features(shape, [(0, 10, True)])
    assert short.attn_swa_flops == short.attn_full_flops / shape.full_layers * shape.swa_layers  # under the window


def test_moe_work_follows_active_experts():
    flash = get_shape("flash")
    one = step_features(flash, [(100, 1, True)])
    many = step_features(flash, [(100, 1, True)] * 64)
    assert one.experts_touched == pytest.approx(flash.moe_layers * flash.experts_per_tok)
    assert flash.moe_layers * flash.experts_per_tok < many.experts_touched < flash.moe_layers * flash.experts
    # Published sizes: MiMo-V2-Flash ~309B total / ~15B active.
    assert 300e9 < flash.total_params < 320e9 and 13e9 < flash.active_params < 16e9


def test_decode_is_memory_bound_and_prefill_compute_bound_on_h200():
    pro, prof = get_shape("pro"), RooflineProfile(gpus=16)
    decode = step_features(pro, [(4096, 1, True)] * 8)
    prefill = step_features(pro, [(0, 16384, True)])

    def mem(f):
        return (
            (pro.dense_params + f.experts_touched * pro.expert_params)
            * 2
            / (prof.hbm_bytes_per_s * prof.bw_efficiency * 16)
        )

    assert prof.step_seconds(decode, pro) == pytest.approx(
        mem(decode) + prof.step_overhead_s + 8 * prof.segment_overhead_s, rel=0.05
    )
    assert prof.step_seconds(prefill, pro) > 5 * prof.step_seconds(decode, pro)


def test_fit_recovers_non_negative_coefficients():
    shape = get_shape("tiny")
    feats, secs = [], []
    for start in (0, 100, 700):
        for n in (1, 16, 200):
            for b in (1, 3):
                f = step_features(shape, [(start, n, True)] * b)
                feats.append(f)
                secs.append(0.002 + 0.0005 * f.segments + 1e-5 * f.tokens + 3e-11 * f.attn_full_flops)
    prof = fit_linear("t", feats, secs)
    assert all(v >= 0 for v in prof.coefficients.values())
    for f, s in zip(feats, secs):
        assert prof.step_seconds(f) == pytest.approx(s, rel=0.02)


def test_committed_cpu_profile_loads_and_reports_its_fit():
    prof = load_profile("cpu-measured")
    assert prof.kind == "linear" and prof.fitted_on["shape"] == "tiny"
    assert "holdout" in prof.fitted_on and prof.fitted_on["holdout"]["steps"] > 0
    with pytest.raises(ValueError, match="device profile"):
        load_profile("no-such-profile")
