"""Tensor and expert parallelism (llm_backend/parallel): real rank processes on gloo against our one-rank engine.

There is no outside reference for a split forward; the one-rank, colocated engine is the reference and greedy
tokens must be identical (the split sums partials in another order, so logits are compared with a tolerance).
- the slicing rules and refusals, by name, without processes;
- loading shard by shard from checkpoints in the released layouts (V2.5's fused QKV pre-split for 4 ranks, FP8
  dequantized at load): every rank's tensors are exactly its part of the whole, and the resident bytes over the
  ranks are the whole plus the replicated parts once per extra rank (measured on the loaded tensors);
- the engine at TP 2 and TP 2 with expert parallelism: text, a prefix-cache hit, media rows, prompt logprobs;
  MTP speculation (the MTP layers split like the main ones), grammar-constrained output, seeded sampling;
  V2.5 at TP 2 and 4; a rank killed or stopped under load fails the replica loudly within the collective timeout.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from llm_backend import LLM, SamplingParams
from llm_backend.models.loader import load_checkpoint
from llm_backend.models.make_checkpoint import write_checkpoint
from llm_backend.parallel.comm import Parallel
from llm_backend.parallel.shard import Shard
from tests.llm.test_kv_tiers import TINY_POOLS
from tests.router.conftest import redis_server  # noqa: F401 - the real redis-server fixture

GREEDY = SamplingParams(max_tokens=10, temperature=0)
OPTS = dict(kv_cache_tokens=1024, swa_cache_tokens=1024, chunk_size=32, torch_threads=1, max_running=4)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 5, list(range(20, 90)), [3, 4, 5]]


@pytest.fixture(scope="module")
def v25(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("v25") / "v2.5-fp8")
    write_checkpoint(d, "v2.5", "fp8")  # fused QKV pre-split for 4 ranks, 128x128 FP8 blocks, 4 shards
    return d


def run(llm: LLM, prompts, params=GREEDY):
    return [o.output_token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


# ------------------------------------------------------------------------------------------- rules, no processes


def test_kv_heads_split_or_replicated_by_vllms_rule():
    assert [Shard(r, 4).kv_part(8) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert [Shard(r, 4).kv_part(2) for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    assert [Shard(r, 2).kv_part(1) for r in range(2)] == [slice(0, 1), slice(0, 1)]


@pytest.mark.parametrize(
    "size, ep, says",
    [
        (3, False, "num_attention_heads (4) is not a multiple of 3"),
        (8, True, "num_attention_heads (4) is not a multiple of 8"),
    ],
)
def test_a_size_the_model_cannot_split_is_refused_naming_the_field(size, ep, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        LLM("tiny", tensor_parallel_size=size, enable_expert_parallel=ep, **OPTS)


def test_kv_heads_neither_multiple_nor_divisor_are_refused():
    from llm_backend.models import TINY_LLM_CONFIG

    cfg = TINY_LLM_CONFIG  # 1 full KV head, 2 sliding: fine at 2 and 4
    Shard(0, 4).check(cfg)
    from dataclasses import replace

    odd = replace(cfg, num_attention_heads=12, num_key_value_heads=3, swa_num_key_value_heads=3)
    with pytest.raises(ValueError, match="3 KV heads, neither a multiple nor a divisor of 2"):
        Shard(0, 2).check(replace(odd, num_attention_heads=12, vocab_size=320))


def test_fp8_kept_resident_split_off_a_block_edge_is_refused_by_name(v25):
    """Tensor-parallel experts of the tiny V2.5 (intermediate 128, FP8 block 128): half an expert's columns is not
    a whole block, so the split is refused naming the tensor, never re-scaled."""
    with pytest.raises(ValueError, match=r"experts.*FP8 block of 128.*--fp8-weights dequantize"):
        load_checkpoint(v25, torch.float32, "keep", progress=False, par=Parallel(Shard(0, 2)))


def test_fp8_kept_resident_is_cut_block_for_block(v25):
    """FP8 kept at TP 2 with expert parallelism: every rank's FP8 bytes and fp32 scales are exactly the whole
    checkpoint's cut (weights by the rules, scales by the same cut in blocks), nothing dequantized or re-scaled."""
    whole = load_checkpoint(v25, torch.float32, "keep", progress=False)
    full, cfg = whole.state_dict(), whole.config
    fp8 = [k for k, v in full.items() if v.dtype == torch.float8_e4m3fn]
    assert fp8
    for r in range(2):
        shard = Shard(r, 2, True)
        part = load_checkpoint(v25, torch.float32, "keep", progress=False, par=Parallel(shard)).state_dict()
        for name, t in part.items():
            if name.endswith("_scale_inv"):
                w = name.removesuffix("_scale_inv")
                want = shard.take_scale(w, tuple(full[w].shape), full[name], cfg)
            else:
                want = shard.take(name, full[name], cfg)
            assert t.dtype == full[name].dtype and t.shape == want.shape, name
            assert torch.equal(
                t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want,
            ), name


@pytest.mark.parametrize("size, ep", [(2, False), (4, False), (2, True)])
def test_each_rank_loads_exactly_its_part_of_a_released_checkpoint(v25, size, ep):
    whole = load_checkpoint(v25, torch.float32, "dequantize", progress=False)
    full = whole.state_dict()
    cfg = whole.config
    held, replicated = 0, 0
    for r in range(size):
        shard = Shard(r, size, ep)
        part = load_checkpoint(v25, torch.float32, "dequantize", progress=False, par=Parallel(shard))
        state = part.state_dict()
        assert set(state) == set(full)
        for name, t in state.items():
            want = shard.take(name, full[name], cfg)
            assert t.shape == want.shape and torch.equal(t, want), name
            if r == 0 and t.shape == full[name].shape:
                replicated += t.numel() * t.element_size()
        held += sum(t.numel() * t.element_size() for t in state.values())
    whole_bytes = sum(t.numel() * t.element_size() for t in full.values())
    assert held == whole_bytes + (size - 1) * replicated
    assert replicated < whole_bytes / 4  # the norms, the router, the MTP combine: the split parts dominate


# ------------------------------------------------------------------------------------------- real ranks


@pytest.fixture(scope="module")
def one_rank():
    llm = LLM("tiny", **OPTS)
    yield llm


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep2"])
def test_tp2_greedy_identical_to_one_rank_with_prefix_hits_media_and_logprobs(one_rank, ep):
    ref = run(one_rank, PROMPTS)
    vocab = one_rank.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    media = {3 + j: torch.randn(one_rank.model.config.hidden_size, generator=g) * 0.05 for j in range(6)}
    mprompt = [5, 6, 7] + [vocab + 100 + j for j in range(6)] + [8, 9, 10, 11]
    scored = SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)

    def media_and_scores(llm):
        r = llm.add_request(mprompt, GREEDY, media=dict(media))
        s = llm.add_request(PROMPTS[1], scored)
        while llm.has_work():
            llm.step()
        return r.output, s.output, s.logprobs

    ref_media, ref_scored, ref_lp = media_and_scores(one_rank)
    llm = LLM("tiny", tensor_parallel_size=2, enable_expert_parallel=ep, **OPTS)
    try:
        assert run(llm, PROMPTS) == ref
        assert run(llm, PROMPTS) == ref and llm.stats()["prefix_hit_tokens"] > 0  # the second pass hits the cache
        got_media, got_scored, got_lp = media_and_scores(llm)
        assert got_media == ref_media and got_scored == ref_scored
        s = llm.stats()
        if ep:  # per-rank expert load: every rank's experts got tokens, the total is every routed pair
            cfg = one_rank.model.config
            moe_layers = cfg.mlp_layer_types.count("sparse")
            assert len(s["ep_tokens_per_rank"]) == 2 and min(s["ep_tokens_per_rank"]) > 0
            assert sum(s["ep_expert_tokens"]) % (cfg.num_experts_per_tok * moe_layers) == 0
            assert sum(s["ep_tokens_per_rank"]) == sum(s["ep_expert_tokens"]) > 0
        else:
            assert "ep_tokens_per_rank" not in s
        assert torch.allclose(torch.tensor(got_lp), torch.tensor(ref_lp), atol=1e-4)
    finally:
        llm.close()


def test_tp2_with_mtp_speculation_grammar_and_seeded_sampling_equals_one_rank(one_rank):
    """MTP speculation at TP 2 drafts and verifies on every rank (each forward mirrored): greedy tokens equal plain
    one-rank decoding, acceptance equal to one-rank speculation's; a JSON-schema constraint and seeded sampled
    requests give one-rank speculation's outputs too (sampling happens on rank 0 from the gathered logits)."""
    from llm_backend.agentic.grammar import ConstraintSpec, GrammarCompilerPool, tokenizer_info

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"]}
    pool = GrammarCompilerPool(tokenizer_info(one_rank.tokenizer, one_rank.model.config.vocab_size, one_rank._eos))
    constrained = SamplingParams(
        max_tokens=40, temperature=0, grammar=pool.compile_sync(ConstraintSpec("json_schema", schema, "x"))
    )
    sampled = SamplingParams(max_tokens=16, temperature=0.9, seed=7)
    long = SamplingParams(max_tokens=40, temperature=0)
    spec = dict(speculative_steps=3, speculative_auto=False)

    def outputs(llm):
        return run(llm, PROMPTS, long), run(llm, PROMPTS[:1], constrained), run(llm, PROMPTS, sampled)

    ref_spec = LLM("tiny", **spec, **OPTS)
    want = outputs(ref_spec)
    assert want[:2] == outputs(one_rank)[:2]  # greedy: speculation changes nothing; sampled: the same law, not draws
    llm = LLM("tiny", tensor_parallel_size=2, **spec, **OPTS)
    try:
        assert outputs(llm) == want
        got, ref = llm.stats(), ref_spec.stats()
        assert got["spec_accepted_tokens"] > 0
        assert got["spec_acceptance_by_position"] == ref["spec_acceptance_by_position"]
    finally:
        llm.close()


EVICTING = {**TINY_POOLS, "torch_threads": 1}


def _shared_prefixes() -> list[list[int]]:
    import random

    rng = random.Random(0)
    systems = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    return [systems[i % 4] + [rng.randrange(3, 250) for _ in range(rng.randrange(3, 20))] for i in range(12)]


def _pairs(llm: LLM) -> list:
    """The shared-prefix prompts two at a time, greedy, 5 tokens each."""
    prompts, sp = _shared_prefixes(), SamplingParams(max_tokens=5, temperature=0)
    return [out for i in range(0, len(prompts), 2) for out in run(llm, prompts[i : i + 2], sp)]


@pytest.fixture(scope="module")
def cold():
    return _pairs(LLM("tiny", prefix_cache=False, **EVICTING))


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """V2-Flash in its released layout (bf16, 4 shards, window 32: a store page carries its window within these
    prompts, so store hits happen)."""
    d = str(tmp_path_factory.mktemp("flash") / "v2-flash")
    write_checkpoint(d, "v2-flash", "bf16")
    return d


def test_tp2_with_the_host_kv_tier_under_heavy_eviction_equals_one_rank(cold):
    """The host tier at TP 2: each rank writes its own heads' KV back to its host rows and loads it again, on rank
    0's slots (parallel/mirror.py MirroredTier). Under heavy eviction of tiny pools, hits that end in the host tier
    give the tokens of one rank with the same tier and of one rank with no cache at all."""
    opts, pairs = EVICTING, _pairs
    one = LLM("tiny", host_kv_bytes=4 << 20, **opts)
    assert pairs(one) == cold
    llm = LLM("tiny", tensor_parallel_size=2, host_kv_bytes=4 << 20, **opts)
    try:
        t = llm.tiers  # the flag is the replica's: each of the 2 ranks holds half of it for its heads
        per_rank = t.host_full.size * t.full_b + t.host_swa.size * t.swa_b
        assert 0.95 * (2 << 20) <= per_rank <= 2 << 20
        assert pairs(llm) == cold
        s = llm.stats()
        assert s["kv_tier_hit_host"] > 0 and s["kv_tier_pages_d2h"] > 0 and s["kv_load_loads"] > 0
    finally:
        llm.close()


def test_tp2_with_the_shared_store_keeps_whole_model_pages(flash, redis_server):  # noqa: F811
    """The shared store at TP 2 (real redis-server, V2-Flash in its released layout): a page is the whole model's
    (every rank's heads, joined on rank 0), so pages a TP-2 worker writes serve a one-rank worker, and pages either
    wrote serve a TP-2 worker, each rank loading its own heads of them; every run gives the tokens of one rank with
    no cache. (Each 40-token prompt is one node, longer than the window: its pages carry the window at its end.)"""
    import random

    rng = random.Random(0)
    opts, sp = {**EVICTING, "chunk_size": 64}, SamplingParams(max_tokens=5, temperature=0)
    first = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    a = LLM(flash, tensor_parallel_size=2, kv_store=redis_server.url, **opts)
    try:
        outs = run(a, first, sp)
        a.tiers.store.flush()
        assert a.stats()["kv_tier_pages_to_store"] > 0
    finally:
        a.close()
    second = [p + o[:4] + [rng.randrange(3, 250) for _ in range(8)] for p, o in zip(first, outs)]  # next turns
    cold = run(LLM(flash, prefix_cache=False, **opts), second, sp)
    b = LLM(flash, kv_store=redis_server.url, **opts)  # one rank, fresh: the TP-2 worker's pages
    assert run(b, second, sp) == cold and b.stats()["kv_tier_hit_store"] >= 4 * 40
    b.tiers.store.flush()
    c = LLM(flash, tensor_parallel_size=2, kv_store=redis_server.url, **opts)  # TP 2, fresh: cut by rank
    try:
        assert run(c, second, sp) == cold and c.stats()["kv_tier_hit_store"] >= 4 * 40
    finally:
        c.close()


def test_v25_fp8_kept_at_tp2_with_expert_parallelism_equals_one_rank(v25):
    prompts = [
        [int(t) for t in torch.randint(9, 4096, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 40)
    ]
    opts = dict(OPTS, fp8_weights="keep")
    ref = run(LLM(v25, **opts), prompts)
    llm = LLM(v25, tensor_parallel_size=2, enable_expert_parallel=True, **opts)
    try:
        assert run(llm, prompts) == ref
        assert any(p.dtype == torch.float8_e4m3fn for p in llm.model.parameters())  # kept FP8 on rank 0
    finally:
        llm.close()


@pytest.mark.parametrize("size", [2, 4])
def test_v25_fused_qkv_checkpoint_at_tp2_and_tp4_equals_one_rank(v25, size):
    prompts = [
        [int(t) for t in torch.randint(9, 4096, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 40)
    ]
    opts = dict(OPTS, fp8_weights="dequantize")
    ref = run(LLM(v25, **opts), prompts)
    llm = LLM(v25, tensor_parallel_size=size, **opts)
    try:
        assert run(llm, prompts) == ref
    finally:
        llm.close()


def test_a_rank_killed_under_load_fails_the_replica_loudly_and_quickly():
    llm = LLM("tiny", tensor_parallel_size=2, dist_timeout_s=10, **OPTS)
    try:
        assert run(llm, PROMPTS[:1])  # serving
        pid = llm.replica.procs[0].pid
        reqs = [llm.add_request(p, SamplingParams(max_tokens=200, temperature=0)) for p in PROMPTS]
        llm.step()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="model-parallel replica down: rank 1"):
            while llm.has_work():
                llm.step()
        assert time.monotonic() - t0 < 15
        assert all(r.finish_reason == "error" and r.error_code == "unavailable" for r in reqs)
        assert "rank 1" in reqs[0].error
    finally:
        llm.close()


def test_a_rank_that_hangs_fails_the_replica_within_the_collective_timeout():
    llm = LLM("tiny", tensor_parallel_size=2, dist_timeout_s=3, **OPTS)
    try:
        assert run(llm, PROMPTS[:1])
        pid = llm.replica.procs[0].pid
        os.kill(pid, signal.SIGSTOP)
        r = llm.add_request(PROMPTS[0], GREEDY)
        t0 = time.monotonic()
        with pytest.raises(Exception, match=r"model-parallel replica down: rank 1 \(pid \d+, stopped\)"):
            while llm.has_work():
                llm.step()
        assert 2 < time.monotonic() - t0 < 20, "failed by the collective timeout (3 s), not at once, never hung"
        assert r.finish_reason == "error" and r.error_code == "unavailable"
    finally:
        llm.close()
        assert not llm.replica, "closed"


def test_a_tp2_worker_serves_the_openai_api_and_exits_when_a_rank_dies(one_worker):
    """`mimo-epd llm --tp 2` as a real process: the OpenAI client gets the one-rank worker's answer, /metrics shows
    the replica; SIGKILL of rank 1 makes the worker exit with status 1 (the supervisor restarts the group)."""
    import openai
    import psutil

    from mimo_epd.testing.servers import scrape, start_server

    ask, want = one_worker
    two = start_server(["--model", "tiny", "--http-port", "0", "--torch-threads", "1", "--tp", "2"], "llm")
    try:
        got = openai.OpenAI(base_url=f"http://{two.http_address}/v1", api_key="x").completions.create(**ask)
        assert got.choices[0].text == want.choices[0].text
        port = int(two.http_address.rsplit(":", 1)[1])
        m = scrape(port)
        assert m["llm_tensor_parallel_size"] == 2 and m["llm_tp_replica_up"] == 1 and m["llm_tp_collectives_total"] > 0
        ranks = psutil.Process(two.proc.pid).children()
        assert len(ranks) >= 1
        for r in ranks:
            if "spawn" in " ".join(r.cmdline()):
                r.kill()
        assert two.proc.wait(timeout=30) == 1
        assert "model-parallel replica down: rank 1" in "".join(two.stderr_lines)
    finally:
        if two.proc.poll() is None:
            two.proc.kill()
