"""Each benchmark's --quick form runs and prints one JSON object of the documented shape (no timing asserts)."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def run_bench(*args, timeout=600) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "mimo_epd", "bench", *args, "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout
    out = json.loads(lines[0])
    machine = out["machine"]  # every benchmark says which machine it ran on
    assert machine["cores"] >= 1 and machine["torch"] and "simd" in machine and "libjpeg_turbo" in machine
    return out


def no_grades(out) -> None:
    """Benchmarks report measurements; they never grade themselves."""
    text = json.dumps(out)
    assert '"goal' not in text, text[:500]


def test_cache_routing_quick():
    out = run_bench("cache-routing")
    no_grades(out)
    assert set(out["hit_rate"]) == {"rr_private", "hash_private", "rr_shared", "hash_shared"}
    assert all(0 <= v <= 1 for v in out["hit_rate"].values())
    assert "hash_vs_rr_private" in out["ratios"]
    # One shared cache of the same total size sees the same stream whatever the placement.
    assert out["hit_rate"]["rr_shared"] == out["hit_rate"]["hash_shared"]


def test_cache_routing_live_fleet_quick():
    """`bench cache-routing --nodes 2`: two live encoders, node-local caches vs the fleet's; the same rows for every
    item in both runs, and the fleet never encodes more than the node-local run (it can only add hits)."""
    import shutil

    import pytest

    from mimo_epd.testing.mooncake_master import master_binary

    if master_binary() is None or shutil.which("redis-server") is None:
        pytest.skip("needs the mooncake-transfer-engine wheel and redis-server")
    out = run_bench("cache-routing", "--nodes", "2")
    no_grades(out)
    assert out["live"] and out["outputs_match"] and out["workload"]["nodes"] == 2
    local, fleet = out["node_local"], out["fleet"]
    assert local["failures"] == fleet["failures"] == 0 and local["items"] == fleet["items"] > 0
    assert local["fleet_hits"] == 0 and fleet["encodes"] <= local["encodes"]
    assert fleet["fleet_hits"] + fleet["lease_waits_served"] > 0  # media repeat across the nodes
    assert {"l3_hit_vs_node_local", "encodes_fleet_vs_node_local"} <= set(out["ratios"])


def test_encoder_bench_quick_with_mimos_tower():
    """`bench encoder --tower mimo`: ours naive and pipelined on MiMo's ViT and preprocessing, the pipelined rows equal
    to naive's (no JPEG draft for MiMo), the reason vLLM is not a CPU peer stated."""
    out = run_bench("encoder", "--tower", "mimo")
    no_grades(out)
    assert set(out["modes"]) == {"naive", "pipelined"} and out["config"]["tower"] == "mimo"
    assert all(m["qps"] > 0 and m["failures"] == 0 for m in out["modes"].values())
    check = out["outputs_check"]["pipelined"]
    assert check["match"] and check["tolerance"] <= 1e-4, check
    assert "Triton" in out["config"]["peer"] and "qps_vs_naive" in out["ratios"]


def test_encoder_bench_quick():
    out = run_bench("encoder")
    no_grades(out)
    assert set(out["modes"]) == {"naive", "pipelined", "peer_per_request", "peer_batched"}
    for name, mode in out["modes"].items():
        assert {"qps", "avg_ms", "p50_ms", "p90_ms", "p99_ms", "cpu_s_per_image"} <= set(mode), name
        assert mode["qps"] > 0 and mode["failures"] == 0 and mode["cpu_s_per_image"] > 0, (name, mode)
        assert mode["p50_ms"] <= mode["p90_ms"] <= mode["p99_ms"]
    for mode in ("naive", "pipelined"):
        m = out["modes"][mode]
        assert set(m["stage_busy"]) == {"fetch", "decode", "preprocess", "encode"}
        assert m["bottleneck_stage"] in m["stage_busy"] and 0 <= m["bottleneck_busy"] <= 1.5
    assert "--resize-backend" not in out["config"]["naive_flags"]  # naive keeps the product's own resize
    assert {"qps_vs_peer_batched", "p90_vs_peer_batched", "qps_vs_naive"} <= set(out["ratios"])
    busy = out["ratios"]["cores_busy"]
    assert set(busy) == set(out["modes"]) and all(0 < v <= out["machine"]["cores"] + 0.5 for v in busy.values()), busy
    forward = out["modes"]["pipelined"]["forward"]
    assert forward["workers"] >= 1 and forward["batch_budget_tokens"] > 0, forward
    # Same weights, same images: every mode's embeddings equal naive's within the documented tolerance.
    assert set(out["outputs_check"]) == {"pipelined", "peer_per_request", "peer_batched"}
    for name, c in out["outputs_check"].items():
        assert c["images"] == 2 and c["max_rel_l2"] <= c["tolerance"], (name, c)
    assert out["outputs_match"] is True


def test_video_bench_quick(tmp_path):
    out = run_bench("video", "--cache-dir", str(tmp_path))
    no_grades(out)
    assert out["video"]["frames_total"] == 300 and out["video"]["frames_sampled"] == 20
    assert set(out["seconds"]) >= {"naive", "parallel", "floor"} and all(v > 0 for v in out["seconds"].values())
    assert set(out["peak_rss_mb"]) == set(out["seconds"]) and all(v > 0 for v in out["peak_rss_mb"].values())
    assert set(out["ratios"]) >= {"naive_vs_parallel", "parallel_vs_floor"}
    assert list(out["scaling"]) == [str(w) for w in range(1, out["cores"] + 1)]
    assert set(out["peers"]) == {f"qwen_vl_utils_{b}" for b in ("torchcodec", "decord", "torchvision")}
    ran = [k for k, v in out["peers"].items() if v["ran"]]
    for k, v in out["peers"].items():
        if k in ran:  # same indices and size as ours, pixels and embedding within the documented tolerance
            c = v["check"]
            assert c["indices_equal"] and c["frame_size_equal"] and c["match"], (k, c)
            assert v["backend_used"] == v["backend"]  # no silent fallback to another reader
        else:
            assert v["error"], (k, v)  # a reader that cannot run says why
    assert ran, out["peers"]  # the dev extra installs at least one working reader (decord)
    assert out["frames_match"] is True and "vs_best_qwen_vl_utils" in out["ratios"]
    assert out["naive_embedding_rel_l2"] <= out["tolerance"]["embedding_rel_l2"]


def test_video_bench_quick_with_mimos_tower(tmp_path):
    """`bench video --tower mimo`: MiMo's sampling (8 frames at least), ours in processes and threads and the
    reference's way give the same rows (bit for bit here); the decode floor is measured beside them."""
    out = run_bench("video", "--tower", "mimo", "--cache-dir", str(tmp_path))
    no_grades(out)
    assert out["tower"] == "mimo" and out["sampling"] == {"fps": 2.0, "min_frames": 8, "max_frames": 256}
    assert out["video"]["frames_sampled"] == 20 and out["video"]["tokens"] > 0
    assert set(out["seconds"]) == {"floor", "parallel", "parallel_threads", "naive"}
    assert all(v > 0 for v in out["seconds"].values()) and out["outputs_match"] is True
    assert out["naive_embedding_rel_l2"] <= 1e-5


def test_video_transport_bench_quick(tmp_path):
    """`bench video --transport`: a live encoder's rows as gRPC bytes and over the transfer engine, equal."""
    out = run_bench("video", "--transport", "--cache-dir", str(tmp_path))
    no_grades(out)
    assert out["bench"] == "video-transport" and out["outputs_match"] is True and out["bytes"] > 0
    assert set(out["seconds"]) == {"grpc", "transfer"} and all(len(v["all"]) == 2 for v in out["seconds"].values())
    assert out["ratios"]["transfer_vs_grpc_seconds"] > 0


def test_cache_routing_hot_item_quick():
    """`bench cache-routing --hot`: a live node under plain hashing and bounded loads, hot replies equal."""
    out = run_bench("cache-routing", "--hot")
    no_grades(out)
    assert out["bench"] == "cache-routing-hot" and out["outputs_match"] is True
    for run in ("plain", "bounded"):
        assert out[run]["failures"] == 0 and out[run]["requests"] == 32 and out[run]["hot"]["requests"] > 0
        assert sum(out[run]["items_per_encoder"]) >= 32
    assert set(out["ratios"]) == {"p90_bounded_vs_plain", "hot_p90_bounded_vs_plain", "qps_bounded_vs_plain"}


def test_kv_bench_quick():
    out = run_bench("kv")
    no_grades(out)
    assert [r["context"] for r in out["contexts"]] == [8192, 32768]
    for r in out["contexts"]:
        assert {
            "context",
            "seqs_hybrid",
            "seqs_full",
            "measured_ratio",
            "theoretical_ratio",
            "fraction_of_theoretical",
        } <= set(r)
        assert r["seqs_full"] >= 1 and r["seqs_hybrid"] > r["seqs_full"]  # the dual pool holds more sequences
        assert r["measured_ratio"] <= r["theoretical_ratio"] * 1.001  # nothing beats the formula
        assert r["decode"]["seqs_hybrid"] <= r["seqs_hybrid"]  # W + N slots per sequence fit no more than W


def synthetic_trace(path, conversations=60, turns=5, seed=0) -> str:
    """A Mooncake-format trace: conversations sharing a system-prompt block, each turn extending the last."""
    import random

    rng = random.Random(seed)
    next_id = iter(range(1, 10**9))
    rows = []
    for c in range(conversations):
        blocks = [0]  # the shared system prompt
        for t in range(turns):
            blocks = blocks + [next(next_id) for _ in range(rng.randint(1, 4))]
            rows.append((c * 1000 + t * 200 + rng.randint(0, 99), blocks))
    rows.sort()
    with open(path, "w") as f:
        for ts, blocks in rows:
            f.write(
                json.dumps(
                    {
                        "timestamp": ts,
                        "input_length": 512 * len(blocks) - rng.randint(0, 400),
                        "output_length": 100,
                        "hash_ids": blocks,
                    }
                )
                + "\n"
            )
    return str(path)


def test_prefix_cache_bench_quick(tmp_path):
    """On the shipped Mooncake trace (the default)."""
    out = run_bench("prefix-cache")
    no_grades(out)
    rates = out["hit_token_rate"]
    assert set(rates) == {"swa_aware", "full_kv", "unbounded"}
    assert 0 <= rates["full_kv"] <= rates["unbounded"] and 0 <= rates["swa_aware"] <= rates["unbounded"] <= 1
    assert rates["unbounded"] > 0  # the trace's requests share prefixes
    assert {"swa_aware_vs_full_kv", "swa_aware_vs_unbounded"} <= set(out["ratios"])


def test_prefix_cache_bench_reads_a_gzipped_trace_of_the_same_format(tmp_path):
    import gzip
    import shutil

    plain = synthetic_trace(tmp_path / "trace.jsonl")
    with open(plain, "rb") as src, gzip.open(tmp_path / "trace.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    a = run_bench("prefix-cache", "--trace", plain)
    b = run_bench("prefix-cache", "--trace", str(tmp_path / "trace.jsonl.gz"))
    assert a["hit_token_rate"] == b["hit_token_rate"] and a["hit_token_rate"]["unbounded"] > 0


def test_prefix_cache_tiers_quick(tmp_path):
    """--tiers: every tier mode reports hit tokens and the tiers' traffic; a host tier never loses hits here and
    nothing beats the unbounded cache (it hits every prefix seen before)."""
    out = run_bench("prefix-cache", "--tiers", timeout=120)
    no_grades(out)
    modes = out["modes"]
    fleets = {f"l1_l2_l3_{p}{w}" for p in ("round_robin", "affinity") for w in ("", "_evict")}
    # The switches flipped from their defaults (back-fill off, checkpoints on): one mode each.
    # The host tier's other policy and write mode: one mode each too.
    tiered = {"l1_l2", "l1_l2_swa_backfill_on", "l1_l2_swa_checkpoint_off", "l1_l2_host_fifo", "l1_l2_write_through"}
    tiered |= fleets
    assert {"swa_aware", "full_kv", "unbounded", "l1"} | tiered == set(modes) == set(out["hit_token_rate"])
    assert out["config"]["requests"] <= 300
    for name, m in modes.items():
        assert m["hit_token_rate"] == out["hit_token_rate"][name]
        assert 0 <= m["hit_tokens"] <= m["prompt_tokens"], name
    for name in tiered:
        t = modes[name]["tiers"]
        for d in ("d2h", "h2d", "s2d"):
            assert t[f"pages_{d}"] >= 0 and t[f"bytes_{d}"] >= 0, (name, t)
        assert (t["pages_h2d"] > 0) == (t["hit_host"] > 0), (name, t)
        # The tiers count a hit in whole token units; the bench caps each request's hit at its real length.
        tier_hits = t["hit_device"] + t["hit_host"] + t["hit_store"]
        assert modes[name]["hit_tokens"] <= tier_hits <= modes[name]["hit_tokens"] + 128 * out["config"]["requests"]
    for name in fleets:
        assert modes[name]["workers"] == 4 and len(modes[name]["hit_tokens_per_worker"]) == 4
        assert modes[name]["store"]["gets"] > 0  # every worker asks the shared store where its tree's match ends
    # written at insert (the default), a prefix one worker computed is loaded from the store by the next one
    assert (
        modes["l1_l2_l3_round_robin"]["store"]["puts"] > 0 and modes["l1_l2_l3_round_robin"]["tiers"]["hit_store"] > 0
    )
    assert out["config"]["tiers"]["store_write"] == "insert"
    assert max(modes["l1_l2_l3_affinity"]["hit_tokens_per_worker"]) < modes["l1_l2_l3_affinity"]["hit_tokens"]
    hits = {k: m["hit_tokens"] for k, m in modes.items()}
    assert hits["l1"] == hits["swa_aware"]  # L1 is the SWA-aware replay at the same budget
    assert hits["l1_l2"] >= hits["l1"]
    assert all(hits["unbounded"] >= v for v in hits.values()), hits
    assert modes["l1_l2"]["tiers"]["pages_d2h"] > 0  # the device evicted into the host tier
    # write-through copies every inserted node: at least the pages write-back copies on eviction
    assert modes["l1_l2_write_through"]["tiers"]["pages_d2h"] >= modes["l1_l2"]["tiers"]["pages_d2h"]
    assert {"host_lru_vs_fifo", "write_back_vs_through"} <= set(out["ratios"])
    assert {"l1_l2_vs_unbounded", "l3_round_robin_vs_affinity", "l3_round_robin_vs_affinity_evict"} <= set(
        out["ratios"]
    )
    assert out["ratios"]["l1_l2_vs_unbounded"] == round(hits["l1_l2"] / hits["unbounded"], 3)


def test_engine_bench_quick():
    out = run_bench("engine")
    no_grades(out)
    engines = out["engines"]
    assert set(engines) == {"ours", "transformers_continuous", "transformers_static_b8", "transformers_static_b64"}
    for name, e in engines.items():
        if not e["ran"]:  # a peer that cannot run this model says why, with its own error
            assert name == "transformers_continuous" and e["error"], e
            continue
        assert e["output_tokens"] == out["config"]["total_output_tokens"], name
        assert e["output_tokens_per_s"] > 0 and 0 < e["ttft_p50_ms"] <= e["ttft_p90_ms"], name
        assert 0 < e["e2e_p50_ms"] <= e["e2e_p90_ms"] and e["peak_rss_mb"] > 0, name
        if name != "ours":
            assert 0 <= e["greedy_agreement"] <= 1
    assert out["best_transformers"] in engines and engines[out["best_transformers"]]["ran"]
    assert "tokens_per_s_vs_best_transformers" in out["ratios"]
    assert out["greedy_agreement"] >= 0.5  # same weights, greedy: the engines produce the same tokens


def test_spec_bench_quick():
    """The trained model's MTP layers: every mode runs, greedy outputs equal plain decoding, accept lengths are
    those of K drafts (1 to K + 1 tokens a verify step)."""
    out = run_bench("spec", "--modes", "off,k1,k3,k3_first_layer,k3_no_prefill_mtp")
    no_grades(out)
    assert out["greedy_identical"] is True
    for key, modes in out["modes"].items():
        assert set(modes) == {"off", "k1", "k3", "k3_first_layer", "k3_no_prefill_mtp"}, key
        assert all(m["output_tokens"] > 0 and m["outputs_equal_off"] for m in modes.values())
        assert 1 <= modes["k1"]["mean_accept_length"] <= 2 and 1 <= modes["k3"]["mean_accept_length"] <= 4
        assert len(modes["k3"]["acceptance_by_position"]) == 3
    assert any(k.startswith("speedup_k3_") for k in out["ratios"])


def test_spec_bench_sim_quick():
    out = run_bench("spec", "--sim")
    no_grades(out)
    assert out["sim"] is True and "model card" in out["config"]["acceptance"]
    for modes in out["modes"].values():
        assert {"off", "k1", "k2", "k3", "k3_no_prefill_mtp"} <= set(modes)
        assert modes["k1"]["mean_accept_length"] < modes["k3"]["mean_accept_length"] <= 4
    r = out["ratios"]
    assert r["speedup_k3_b1_0_128"] > 0 and r["speedup_k3_b16_128_256"] > 0


def test_structured_bench_quick():
    """Every mode runs at batch 1 and 16; constrained outputs are valid where they finished, compile times and
    the ratios the report names are there."""
    out = run_bench("structured")
    no_grades(out)
    assert set(out["modes"]) == {f"{m}_b{b}" for m in ("unconstrained", "json_schema", "regex") for b in (1, 16)}
    assert all(m["output_tokens"] > 0 for m in out["modes"].values())
    js = out["modes"]["json_schema_b16"]
    assert js["valid_json_schema"] >= js["finish_stop"]  # every finished output validates
    assert {"tokens_per_s_json_schema_vs_unconstrained_b16", "valid_json_schema", "valid_unconstrained"} <= set(
        out["ratios"]
    )
    assert out["compile"]["json_schema"]["cached_ms"] < out["compile"]["json_schema"]["cold_ms"]


def test_audio_quick():
    out = run_bench("audio")
    no_grades(out)
    assert out["bounded"] and out["outputs_match"] and out["hour"]["rel_l2"] < 1e-4
    assert set(out["ratios"]) == {
        "hour_vs_transformers",
        "clips_qps_vs_peer",
        "clips_p90_vs_peer",
        "clips_qps_vs_peer_per_request",
        "clips_p90_vs_peer_per_request",
    }
    for side in ("ours", "transformers"):
        assert out["hour"][side]["seconds"] > 0 and out["hour"][side]["peak_rss_mb"] > 0
    assert out["clips"]["outputs_match"]  # every clip's embedding equal across ours and both peers
    for side in ("ours", "peer_batched", "peer_per_request"):
        assert out["clips"][side]["failures"] == 0 and out["clips"][side]["requests"] == out["clips"]["n"]


def test_audio_quick_with_mimos_tokenizer(tmp_path):
    """`bench audio --tower mimo`: the streamed path and the whole-item reference path give the same rows on the file
    (bit for bit) and on every clip; why vLLM is not run is stated."""
    out = run_bench("audio", "--tower", "mimo", "--cache-dir", str(tmp_path))
    no_grades(out)
    assert out["tower"] == "mimo" and out["bounded"] and out["outputs_match"] and out["hour"]["rel_l2"] == 0.0
    assert set(out["ratios"]) == {
        "hour_vs_whole_item",
        "clips_qps_vs_peer_per_request",
        "clips_p90_vs_peer_per_request",
    }
    assert out["hour"]["tokens"] > 700 and "flash-attention" in out["note"]
    for side in ("ours", "peer_per_request"):
        assert out["clips"][side]["failures"] == 0 and out["clips"][side]["requests"] == out["clips"]["n"]


def test_encoder_bench_repeats_report_the_median_run_and_paired_ranges():
    """`bench encoder --repeats N`: each mode's figures are its median-QPS run, whole; `ratios_range` pairs ours
    with each peer within one repetition; `--forward-shapes` names ours with the shape fixed."""
    from mimo_epd.bench.encoder import median_run, paired_range, shape_flags

    runs = {
        "pipelined": [{"qps": 30.0, "p90_ms": 1}, {"qps": 20.0, "p90_ms": 2}, {"qps": 40.0, "p90_ms": 3}],
        "peer_per_request": [{"qps": 10.0}, {"qps": 10.0}, {"qps": 20.0}],
        "peer_batched": [{"qps": 12.0}, {"qps": 8.0}, {"qps": 16.0}],
        "naive": [{"qps": 10.0}, {"qps": 0.0}, {"qps": 10.0}],
    }
    med = median_run(runs["pipelined"])
    assert med["qps"] == 30.0 and med["p90_ms"] == 1 and med["qps_runs"] == [30.0, 20.0, 40.0]
    assert "qps_runs" not in median_run(runs["pipelined"][:1])
    assert median_run(runs["pipelined"][:2])["qps"] == 20.0  # of two runs, the slower
    assert paired_range(runs) == {
        "qps_vs_peer_per_request": [2.0, 3.0],
        "qps_vs_peer_batched": [2.5, 2.5],
        "qps_vs_naive": [3.0, 4.0],  # a repetition whose peer served nothing is left out
    }
    assert shape_flags("1x2,2x1") == {
        "pipelined 1x2": ["--forward-workers", "1", "--torch-threads", "2"],
        "pipelined 2x1": ["--forward-workers", "2", "--torch-threads", "1"],
    }
    assert shape_flags("") == {}


def test_parallel_bench_quick():
    """TP 2 and DP 2 (data-parallel attention, expert parallel) against one process: outputs identical, rank 0's
    collectives counted (TP: 18 a step on the tiny model, two per layer, the embedding's, the logits'; DP: one round
    per sparse layer, 7 a forward), the issue's ratio named."""
    out = run_bench("parallel", "--modes", "tp1,tp2,dp2_ep")
    no_grades(out)
    assert out["outputs_identical"] is True
    for key in ("b1", "b16"):
        assert out["modes"]["tp1"][key]["output_tokens_per_s"] > 0
        tp2 = out["modes"]["tp2"][key]
        assert tp2["collective_calls"] > 0 and tp2["collective_calls"] % 18 == 0
        assert 0 < tp2["collective_share_of_wall"] < 1
        dp2 = out["modes"]["dp2_ep"][key]
        assert dp2["collective_rounds"] > 0 and dp2["collective_rounds"] % 7 == 0
    assert "tp2_vs_tp1_tokens_per_s_b16" in out["ratios"] and "dp2_ep_vs_tp1_tokens_per_s_b16" in out["ratios"]
