"""The simulated worker and fleet: real Scheduler / caches on a virtual clock, deterministic, fair, and equal
to the live engine's cached tokens."""

import io
import json
from contextlib import redirect_stdout

import pytest

from llm_backend.sim import CostModel, SimRequest, SimWorker, WorkerConfig, get_shape, load_profile, simulate
from llm_backend.sim.calibrate import validate
from llm_backend.sim.cost import RooflineProfile
from mimo_epd.cli import main as cli
from mimo_epd.sim.fleet import Fleet

PRO = CostModel(get_shape("pro"), RooflineProfile(gpus=16))


def _req(i, t, prompt, out):
    return SimRequest(i, t, list(prompt), len(prompt), out)


@pytest.mark.parametrize("unit", [1, 16])
def test_decode_is_per_real_token_in_any_unit(unit):
    """Every request generates exactly its output length in real tokens, and with one request alone the decode
    takes one step per token whatever the unit."""
    cfg = WorkerConfig(full_tokens=1 << 16, swa_tokens=1 << 14, page_size=16, chunk_size=512, max_running=4, unit=unit)
    prompt = list(range(2000 // unit))
    w = simulate(SimWorker(PRO, cfg), [SimRequest(0, 0.0, prompt, 2000, 37)])
    (f,) = w.finished
    assert f.output_len == 37 and f.reason == "length"
    assert w.runner.steps == 4 + 36  # four prefill chunks (the last samples), then 36 decode steps
    assert f.first_token < f.finish


def test_trace_output_ids_are_what_the_worker_caches():
    cfg = WorkerConfig(full_tokens=4096, swa_tokens=2048, page_size=1, chunk_size=64, max_running=2, unit=1)
    outs = [11, 12, 13, 14]
    first = SimRequest(0, 0.0, [1, 2, 3, 4, 5], 5, 4, outs)
    follow = SimRequest(1, 100.0, [1, 2, 3, 4, 5] + outs + [6], 10, 1)
    w = simulate(SimWorker(PRO, cfg), [first, follow])
    assert [f.cached_tokens for f in sorted(w.finished, key=lambda f: f.index)] == [0, 8]  # prompt + 3 cached outputs


def test_nothing_starves_under_a_flood_of_short_requests():
    """One long prompt among a flood of short ones keeping the worker saturated. With the wait penalty it is
    admitted while the flood goes on; with no penalty and no length buckets (pure fewest-uncached-first) it
    waits for the flood to end, which shows the check can fail."""
    shorts = [_req(i + 1, 0.05 * i, [10_000 + i] * 0 + list(range(i * 1000, i * 1000 + 40)), 30) for i in range(400)]
    long = _req(0, 0.5, list(range(10**7, 10**7 + 600)), 4)

    def run(penalty, buckets):
        cfg = WorkerConfig(
            full_tokens=1 << 15,
            swa_tokens=1 << 13,
            page_size=1,
            chunk_size=64,
            max_running=2,
            wait_penalty=penalty,
            length_buckets=buckets,
            unit=1,
        )
        cost = CostModel(get_shape("tiny"), load_profile("cpu-measured"))
        w = simulate(SimWorker(cost, cfg), [long] + shorts)
        done = {f.index: f for f in w.finished}
        assert len(done) == 401
        return done[0].first_token, max(f.arrival for f in done.values())

    ttft_fair, last_arrival = run(2048.0, ())
    assert ttft_fair < last_arrival / 2
    ttft_starved, last_arrival = run(0.0, ())
    assert ttft_starved > last_arrival
    ttft_buckets, _ = run(0.0, (300,))  # its own length bucket takes turns with the shorts'
    assert ttft_buckets < last_arrival / 2


def _sessions(n_conv=13, turns=4, block=64):  # 13: round-robin does not land a conversation on one worker by chance
    reqs, k = [], 0
    for t in range(turns):
        for c in range(n_conv):
            base = [c * 100_000 + j for j in range((t + 1) * block * 3)]
            reqs.append(SimRequest(k, 0.02 * k, base, len(base), 8))
            k += 1
    return reqs


def test_fleet_index_mirrors_every_worker_and_affinity_reuses_more_than_round_robin():
    cfg = WorkerConfig(full_tokens=1 << 14, swa_tokens=1 << 12, page_size=16, chunk_size=256, max_running=8, unit=1)
    hits = {}
    for pol in ("affinity", "round_robin"):
        fleet = Fleet(PRO, cfg, 3, pol)
        res = fleet.run(_sessions())
        assert res["requests"] == 52
        for w, pub in zip(fleet.workers, fleet.publishers):
            assert fleet.index.blocks(w.name) == len(pub.blocks) > 0  # the index is what each worker published
        hits[pol] = res["hit_tokens"]
    assert hits["affinity"] > 1.5 * hits["round_robin"]


def _cli_json(argv):
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli(argv) == 0
    return json.loads(buf.getvalue())


def test_sim_run_is_deterministic(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 40 * i,
                    "input_length": 700 + 300 * (i % 5),
                    "output_length": 20,
                    "hash_ids": [0] + [i % 4 * 10 + j for j in range(1 + i % 5)],
                }
            )
            + "\n"
            for i in range(30)
        )
    )
    argv = ["sim", "run", "--trace", str(trace), "--workers", "3", "--policies", "affinity,cache_aware,kv_cost"]
    a, b = _cli_json(argv), _cli_json(argv)
    assert a == b
    assert set(a["policies"]) == {"affinity", "cache_aware", "kv_cost"}
    r = a["policies"]["affinity"]
    assert r["requests"] == 30 and r["ttft_s"]["all"]["p90"] > 0 and r["hit_tokens"] > 0
    assert set(r["queue"]) == {"t", "waiting", "running"}
    c = _cli_json(
        [
            "sim",
            "run",
            "--trace",
            "long-mix",
            "--requests",
            "12",
            "--seed",
            "1",
            "--shape",
            "pro",
            "--kv-gib",
            "160",
            "--chunk-size",
            "16384",
            "--unit",
            "128",
            "--workers",
            "1",
            "--policies",
            "affinity",
        ]
    )
    d = _cli_json(
        [
            "sim",
            "run",
            "--trace",
            "long-mix",
            "--requests",
            "12",
            "--seed",
            "2",
            "--shape",
            "pro",
            "--kv-gib",
            "160",
            "--chunk-size",
            "16384",
            "--unit",
            "128",
            "--workers",
            "1",
            "--policies",
            "affinity",
        ]
    )
    assert c["policies"]["affinity"]["requests"] == 12 and c != d


def test_bad_flags_are_named():
    with pytest.raises(SystemExit, match="unknown routing policy 'nope'"):
        _cli_json(["sim", "run", "--quick", "--policies", "nope"])
    with pytest.raises(SystemExit, match="--unit 48 must divide"):
        _cli_json(["sim", "run", "--quick", "--unit", "48"])


def test_cached_tokens_equal_the_live_engine():
    """The live tiny engine and the simulated worker (unit 1, same pools / chunk / page, the live outputs as
    the trace) give every request the same cached tokens, through hits, evictions and preemptions."""
    res = validate(load_profile("cpu-measured"), seed=5, waves=2)
    assert res["requests"] == 16 and res["cached_tokens"]["live"] > 0
    assert res["preemptions"]["live"] == res["preemptions"]["sim"]
    assert res["steps"]["live"] == res["steps"]["sim"]
    assert res["cached_tokens_equal"], res["mismatched_requests"]
    assert 0 <= res["step_time_error"] == res["step_time_error_committed_profile"]
    assert res["same_machine"] in (True, False, None)


def test_validate_calibrates_here_and_reports_both_profiles():
    """With calibrate_here the profile fitted on this machine's steps is judged next to the given one on the
    same live run; a profile scaled 10x too slow is worse than this machine's own fit, and says so. (10x, not
    less: machines of this kind differ by up to 2x from the one that fitted the committed profile.)"""
    import math
    from dataclasses import replace

    from llm_backend.sim.calibrate import cpu_model

    slow = load_profile("cpu-measured")
    slow = replace(slow, coefficients={k: 10 * v for k, v in slow.coefficients.items()}, fitted_on={"cpu": "other"})
    res = validate(slow, seed=5, waves=2, calibrate_here=True, train_seed=1)
    cal = res["calibration"]
    assert cal["same_machine"] is False and cal["this_machine"]["cpu"] == cpu_model()
    assert res["step_time_error"] == cal["this_machine"]["per_step_median_error"]
    assert res["step_time_error_committed_profile"] == cal["committed_profile"]["per_step_median_error"]
    assert res["step_time_error"] < res["step_time_error_committed_profile"]
    slow_ratio = cal["measured_vs_committed_prediction"]
    assert slow_ratio < 0.5  # the slow profile predicts several times the measured time
    own_ratio = cal["this_machine"]["measured_s"] / cal["this_machine"]["predicted_s"]
    assert abs(math.log(own_ratio)) < abs(math.log(slow_ratio))  # this machine's fit predicts the total better
    assert cal["profile"]["fitted_on"]["cpu"] == cpu_model()


# ----------------------------------------------------------------------------------------------- KV tiers
def test_tier_links_price_loads_with_and_without_overlap():
    from llm_backend.sim.tiers import TierLinks

    links = TierLinks(pcie_bytes_per_s=10e9, store_bytes_per_s=1e9, gpus=2, layers=10)
    assert links.load_seconds(20e9, 0) == pytest.approx(1.0)  # 20 GB over 2 GPUs x 10 GB/s
    assert links.load_seconds(0, 3e9) == pytest.approx(3.0)
    assert links.step_seconds(5.0, 1.0) == pytest.approx(5.0)  # hidden behind the forward, layer by layer
    assert links.step_seconds(1.0, 5.0) == pytest.approx(5.1)  # exposed: only the last layer waits on top
    assert TierLinks(overlap=False).step_seconds(1.0, 5.0) == 6.0
    assert links.step_seconds(1.0, 0.0) == 1.0


def _evicting_fleet(policy, store_bytes, links=None, host=0, swa=2400, backfill=False):
    from dataclasses import replace

    from llm_backend.sim.tiers import TierLinks

    cfg = WorkerConfig(full_tokens=3000, swa_tokens=swa, page_size=16, chunk_size=256, max_running=4, unit=1)
    if store_bytes or host:
        cfg = replace(
            cfg, host_full_tokens=host, host_swa_tokens=host // 4, links=links or TierLinks(), swa_backfill=backfill
        )
    return Fleet(PRO, cfg, 2, policy, store_bytes=store_bytes).run(_sessions(turns=3))


def test_a_fleet_with_a_shared_store_reuses_what_round_robin_spreads_and_pays_for_the_loads():
    from llm_backend.sim.tiers import TierLinks

    plain = _evicting_fleet("round_robin", 0)
    slow = _evicting_fleet("round_robin", 10**12, TierLinks(store_bytes_per_s=1e8, overlap=False))
    free = _evicting_fleet("round_robin", 10**12, TierLinks(store_bytes_per_s=float("inf")))
    assert plain["requests"] == slow["requests"] == free["requests"] == 39
    assert "hit_tokens_by_tier" not in plain
    assert slow["hit_tokens_by_tier"]["store"] > 0 and slow["hit_tokens"] > plain["hit_tokens"]
    loads = slow["tier_loads"]
    assert loads["store_bytes"] > 0 and loads["load_s"] > 0
    assert loads["exposed_s"] == pytest.approx(loads["load_s"])  # no overlap: every copy is on the step's path
    assert free["tier_loads"]["load_s"] == 0 and free["tier_loads"]["store_bytes"] > 0
    # the same hits, a slow link: the loads are in the TTFT
    assert slow["ttft_s"]["all"]["p90"] > free["ttft_s"]["all"]["p90"]


def test_a_host_tier_in_the_simulator_keeps_hits_the_device_pools_lost():
    plain = _evicting_fleet("affinity", 0)
    tiered = _evicting_fleet("affinity", 0, host=12000)
    assert tiered["hit_tokens_by_tier"]["host"] > 0 and tiered["hit_tokens"] > plain["hit_tokens"]
    assert tiered["tier_loads"]["host_bytes"] > 0


def test_swa_backfill_keeps_the_hits_a_scarce_swa_pool_tombstones():
    # an SWA pool of ~9 windows: SWA eviction tombstones node ends long before the full pool evicts anything
    plain = _evicting_fleet("affinity", 0, swa=1200)
    off = _evicting_fleet("affinity", 0, host=12000, swa=1200)
    on = _evicting_fleet("affinity", 0, host=12000, swa=1200, backfill=True)
    assert off["hit_tokens"] == plain["hit_tokens"]  # no device eviction: the host tier alone gets nothing
    assert on["hit_tokens_by_tier"]["host"] > 0 and on["hit_tokens"] > 1.5 * off["hit_tokens"]
