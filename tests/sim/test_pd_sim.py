"""The P/D simulator: prefill and decode pools with the real decode scheduler, a network cost per transfer."""

from __future__ import annotations

from llm_backend.pd.rule import TransferRule
from llm_backend.sim.cost import CostModel, load_profile
from llm_backend.sim.engine import WorkerConfig
from llm_backend.sim.shapes import get_shape
from llm_backend.sim.trace import SimRequest
from mimo_epd.sim.pd import Network, PDFleet


def _fleet(**kw):
    shape = get_shape("flash")
    cost = CostModel(shape, load_profile("h200", None))
    cfg = WorkerConfig(full_tokens=1 << 20, swa_tokens=1 << 16, page_size=128, chunk_size=8192, unit=16)
    return shape, PDFleet(cost, cfg, 1, 2, **kw)


def _requests(n: int, length: int, out: int = 32) -> list[SimRequest]:
    return [SimRequest(i, 0.05 * i, [(i << 20) + j for j in range(length // 16)], length, out) for i in range(n)]


def test_every_request_is_prefilled_remotely_and_moves_the_rules_bytes():
    shape, fleet = _fleet()
    res = fleet.run(_requests(6, 16384))
    assert res["requests"] == 6 and res["errors"] == 0 and res["transfers"] == 6 and res["local_prefills"] == 0
    want = TransferRule(16384, 0, shape.window, 128).bytes(shape.kv_bytes_full, shape.kv_bytes_swa)
    assert res["transfer_bytes_per_request"] == want < res["full_kv_bytes_per_request"]
    for w in fleet.decode:
        for f in w.finished:
            assert f.first_token - f.arrival > Network().seconds(want)  # the first token waits for the KV
            assert f.output_len == 32


def test_short_prompts_are_prefilled_on_the_decode_worker():
    _, fleet = _fleet(local_prefill_tokens=4096)
    res = fleet.run(_requests(4, 2048) + [SimRequest(9, 0.5, list(range(1 << 30, (1 << 30) + 1024)), 16384, 8)])
    assert res["requests"] == 5 and res["local_prefills"] == 4 and res["transfers"] == 1


def test_bench_pd_quick_reports_every_split_and_the_ratios():
    import argparse

    from mimo_epd.bench import pd

    p = argparse.ArgumentParser()
    pd.add_arguments(p)
    out = pd.main(
        p.parse_args(
            ["--shapes", "flash", "--traces", "mooncake", "--requests", "12", "--rates", "1", "--workers", "2"]
        )
    )
    res = out["results"]["flash/mooncake"]
    assert set(res["modes"]) == {"colocated", "1P:1D"} and res["best_split"] == "1P:1D"
    r = out["ratios"]["flash/mooncake"]
    assert 0 < r["transfer_bytes_vs_full_kv"] < 1
    assert {"goodput_disagg_vs_colocated", "ttft_p90_disagg_vs_colocated", "tpot_p90_disagg_vs_colocated"} <= set(r)
    placed = res["prefill_placement"]
    assert set(placed) == {"affinity", "round_robin"}
    assert {"prefill_affinity_cached_vs_round_robin", "prefill_affinity_ttft_p90_vs_round_robin"} <= set(r)


def _sessions(turns: int, sessions: int, length: int) -> list[SimRequest]:
    """`sessions` conversations whose turn t re-sends the turn before it plus `length` new tokens."""
    out, i = [], 0
    for t in range(turns):
        for s in range(sessions):
            prompt = [(s << 24) + j for j in range((t + 1) * length // 16)]
            out.append(SimRequest(i, 2.0 * t + 0.01 * s, prompt, (t + 1) * length, 4))
            i += 1
    return out


def test_prefill_placed_by_affinity_finds_the_sessions_prefix_round_robin_does_not():
    def run(policy):
        shape = get_shape("flash")
        cost = CostModel(shape, load_profile("h200", None))
        cfg = WorkerConfig(full_tokens=1 << 20, swa_tokens=1 << 16, page_size=128, chunk_size=8192, unit=16)
        fleet = PDFleet(cost, cfg, 2, 1, prefill_policy=policy)
        return fleet.run(_sessions(4, 3, 8192))

    aff, rr = run("affinity"), run("round_robin")
    assert aff["transfers"] == rr["transfers"] == 12
    # affinity: turns 2-4 of a session prefill where turn 1 did, finding (t-1)/t of the prompt cached
    assert aff["prefill_cached_fraction"] > 0.45
    assert rr["prefill_cached_fraction"] < 0.8 * aff["prefill_cached_fraction"]


def test_bench_pd_goodput_is_searched_between_grid_rates():
    """A grid whose first rate passes and second fails: the goodput lands strictly between them after the search,
    with its bracket, and every searched rate's attainment reported (monotone across the bracket)."""
    import argparse

    from mimo_epd.bench import pd

    p = argparse.ArgumentParser()
    pd.add_arguments(p)
    args = p.parse_args(
        ["--shapes", "flash", "--traces", "mooncake", "--requests", "40", "--rates", "1,1024", "--workers", "2"]
        + ["--search-steps", "3"]
    )
    out = pd.main(args)
    searched = 0
    for mode, row in out["results"]["flash/mooncake"]["modes"].items():
        att = row["attainment"]
        if att["1.0"] >= args.slo_share and att["1024.0"] < args.slo_share:
            lo, hi = row["goodput_bracket"]
            assert 1.0 <= lo < hi <= 1024.0 and row["goodput_rate_factor"] == lo, mode
            assert len(att) == 2 + 3 and att[str(lo)] >= args.slo_share, mode
            searched += 1
        else:
            assert "goodput_bracket" not in row, mode
    assert searched >= 1  # the split's grid passes at 1 and fails at 1024: its goodput was searched
    assert out["search_steps"] == 3


def test_role_splits_use_every_gpu_of_the_fleet_once():
    from mimo_epd.bench.pd_roles import role_modes

    modes = role_modes(4, 8, [4, 8, 16])
    assert all(p * tp_p + d * tp_d == 32 and p >= 1 and d >= 1 for p, tp_p, d, tp_d in modes.values())
    assert {"7Px4:1Dx4", "2Px8:1Dx16", "1Px16:2Dx8", "4Px4:2Dx8"} <= set(modes) and "4Px8:0Dx8" not in modes
    assert len(modes) == len(set(modes.values()))


def test_bench_pd_role_parallelism_runs_each_role_at_its_own_tp():
    """`--role-parallelism`: the colocated fleet and every split of its GPUs with each role at its own TP, on the
    same arrivals; a TP whose GPUs cannot hold the trace's prompts after the weights is left out, named."""
    import argparse

    from mimo_epd.bench import pd
    from mimo_epd.bench.pd_roles import role_modes

    p = argparse.ArgumentParser()
    pd.add_arguments(p)
    args = ["--shapes", "flash", "--traces", "long-context", "--requests", "12", "--rates", "1", "--workers", "2"]
    out = pd.main(p.parse_args([*args, "--role-parallelism", "--role-tp", "2,8", "--search-steps", "0"]))
    roles = out["results"]["flash/long-context"]["role_parallelism"]
    assert roles["gpus"] == 16 and "2" in roles["skipped"] and "KV tokens" in roles["skipped"]["2"]
    want = {"colocated_2x8"} | set(role_modes(2, 8, [8]))  # TP 2 cannot hold V2-Flash's FP8 weights and KV
    assert set(roles["modes"]) == want and roles["best"] in want
    for row in roles["modes"].values():
        assert set(row["attainment"]) == {"1.0"} and 0 <= row["attainment"]["1.0"] <= 1
