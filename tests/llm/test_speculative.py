"""MTP speculative decoding (llm_backend/engine/speculative.py): outputs identical to plain decoding whatever the
drafts are (random MTP layers accept almost nothing; oracle drafts accept everything; half-right drafts accept a
prefix), stops inside an accepted run cut exactly there, the sampled distribution is unchanged (a chi-square test),
and both KV pools stay exact: the accounting invariant after every step, pools back to idle, no drafted position
in the tree — with a regression test for each speculation + SWA bug peers shipped."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch

from llm_backend.engine.llm import LLM
from llm_backend.engine.request import SamplingParams
from llm_backend.engine.speculative import SpeculativeRunner
from llm_backend.models import TINY_LLM_CONFIG, MiMoV2FlashForCausalLM, init_random_weights
from tests.router.conftest import redis_server  # noqa: E402,F401 - the real redis-server fixture

CFG = replace(TINY_LLM_CONFIG, num_hidden_layers=4, layer_types=[], mlp_layer_types=[], num_nextn_predict_layers=3)
CFG.__post_init__()
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    m = MiMoV2FlashForCausalLM(CFG)
    init_random_weights(m, 0)
    return m.eval()


def prompts(n=4, seed=0, lo=5, hi=200):
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def engine(model, **kw):
    opts = dict(
        kv_cache_tokens=2048,
        swa_cache_tokens=1024,
        page_size=4,
        chunk_size=64,
        release_interval=4,
        speculative_auto=False,
    )
    opts.update(kw)
    return LLM(model, **opts)


def outputs(llm, ps, sp=GREEDY):
    return [o.output_token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=sp)]


def idle(llm) -> None:
    """Nothing runs: every slot is free or held by the tree; evicting the tree frees every slot."""
    acc = llm.cache.accounting()
    assert acc.full.protected == 0 and acc.swa.protected == 0
    assert llm.full_pool.available() + acc.full.evictable == llm.full_pool.size
    assert llm.swa_pool.available() + acc.swa.evictable == llm.swa_pool.size
    llm.cache.evict_full(10**9)
    llm.cache.evict_swa(10**9)
    assert llm.full_pool.available() == llm.full_pool.size and llm.swa_pool.available() == llm.swa_pool.size


class Oracle:
    """Drafts from a known continuation (`right`: which draft positions 0..K-1 are given the true token)."""

    def __init__(self, truth: dict[tuple, list[int]], right=(0, 1, 2)):
        self.truth, self.right = truth, right

    def install(self, runner: SpeculativeRunner) -> None:
        def pick(r, hidden, slot):
            out = self.truth[tuple(r.prompt)]
            i = slot - len(r.prompt)  # output index of the drafted token
            pos = slot - (len(r.tokens) - 1) - 1  # its draft position
            ok = pos in self.right and i < len(out)
            return (out[i] if ok else (out[i] + 1) % 250 if i < len(out) else 0), None

        runner._pick = pick


@pytest.mark.parametrize("layers,prefill_mtp", [("chain", True), ("chain", False), ("first", True)])
def test_greedy_outputs_identical_with_random_mtp_layers(model, layers, prefill_mtp):
    ps = prompts()
    want = outputs(engine(model), ps)
    llm = engine(model, speculative_steps=3, speculative_layers=layers, prefill_mtp=prefill_mtp)
    assert outputs(llm, ps) == want
    s = llm.stats()
    assert s["spec_verify_steps"] > 0 and s["spec_drafted_tokens"] == 3 * s["spec_verify_steps"]
    idle(llm)


def test_oracle_drafts_are_all_accepted_and_outputs_identical(model):
    ps = prompts(seed=1)
    want = outputs(engine(model), ps)
    llm = engine(model, speculative_steps=3)
    Oracle({tuple(p): o for p, o in zip(ps, want)}).install(llm.runner)
    assert outputs(llm, ps) == want
    s = llm.stats()
    assert s["spec_acceptance_by_position"] == [1.0, 1.0, 1.0]
    # every verify step yields 4 tokens: 24 tokens = the first (from prefill) + 23 in ceil(23 / 4) = 6 steps
    assert s["spec_verify_steps"] == 6 * len(ps)
    idle(llm)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_a_wrong_draft_ends_the_accepted_run(model, steps):
    ps = prompts(seed=2)
    want = outputs(engine(model), ps)
    llm = engine(model, speculative_steps=steps)
    Oracle({tuple(p): o for p, o in zip(ps, want)}, right=(0,)).install(llm.runner)  # only the first is right
    assert outputs(llm, ps) == want
    acc = llm.stats()["spec_acceptance_by_position"]
    assert acc[0] == 1.0 and all(a == 0.0 for a in acc[1:])
    idle(llm)


def test_stop_token_and_max_tokens_inside_an_accepted_run(model):
    ps = prompts(n=3, seed=3)
    free = outputs(engine(model), ps)
    stop = free[0][9]  # a token the first request emits at position 9 (inside a 4-token run)
    for sp in (
        SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,)),
        SamplingParams(max_tokens=11, ignore_eos=True),
    ):
        want = outputs(engine(model), ps, sp)
        llm = engine(model, speculative_steps=3)
        Oracle({tuple(p): o for p, o in zip(ps, free)}).install(llm.runner)
        res = llm.generate(prompt_token_ids=ps, sampling_params=sp)
        assert [o.output_token_ids for o in res] == want
        assert [o.usage.completion_tokens for o in res] == [len(w) for w in want]
        idle(llm)


def test_accounting_after_every_step_under_eviction_and_preemption(model):
    """Small pools: the tree evicts, younger requests are preempted; after every step, for both pools, free +
    evictable + protected + what running requests own == total (SGLang #40681: available + evictable > total;
    #34823: out-of-window frees in mixed units; #27789: a page leak with page_size > 1)."""
    ps = prompts(n=8, seed=4, lo=60, hi=240)
    want = outputs(engine(model, kv_cache_tokens=1200, swa_cache_tokens=520, max_running=4), ps)
    llm = engine(model, kv_cache_tokens=1200, swa_cache_tokens=520, max_running=4, speculative_steps=3)
    Oracle({tuple(p): o for p, o in zip(ps, want)}, right=(0, 1)).install(llm.runner)
    reqs = [llm.add_request(p, GREEDY) for p in ps]
    while llm.has_work():
        llm.step()
        acc = llm.cache.accounting()
        running = [r for r in llm.scheduler.running if r.kv is not None]
        own_full = sum(r.kv.own_full_slots() for r in running)
        own_swa = sum(r.kv.own_swa_live() for r in running)
        assert llm.full_pool.available() + acc.full.evictable + acc.full.protected + own_full == llm.full_pool.size
        assert llm.swa_pool.available() + acc.swa.evictable + acc.swa.protected + own_swa == llm.swa_pool.size
        for r in running:  # no draft placeholder survives a step
            assert -1 not in r.kv.tokens and r.kv.tokens == r.tokens[: len(r.kv.tokens)]
    assert [r.output for r in reqs] == want
    assert llm.preemptions > 0 or llm.cache.stats.full_evicted > 0  # the pools were under pressure
    idle(llm)


def test_no_drafted_token_reaches_the_tree(model):
    """Every path in the tree is a prompt + output prefix of some request (drafts were rolled back first)."""
    ps = prompts(n=4, seed=5)
    llm = engine(model, speculative_steps=3)  # random MTP layers: nearly every draft is rejected
    res = llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    seqs = [p + o.output_token_ids for p, o in zip(ps, res)]

    def walk(node, prefix):
        for child in node.children.values():
            path = prefix + child.key
            assert any(s[: len(path)] == path for s in seqs), "a cached path no request produced"
            walk(child, path)

    walk(llm.cache.root, [])
    assert llm.cache.token_count() > 0


def test_draft_slots_never_preempt_or_fail_a_request(model):
    """SGLang #28219 (draft KV not reserved for hybrid SWA): with an SWA pool that holds barely the running
    windows, drafts are skipped when they do not fit; nothing fails and nothing is preempted that plain decoding
    would not preempt."""
    ps = prompts(n=4, seed=6, lo=100, hi=140)
    opts = dict(swa_cache_tokens=4 * (128 + 8) + 64 + 4 + 1, max_running=4)
    base = engine(model, **opts)
    want = outputs(base, ps)
    llm = engine(model, speculative_steps=3, **opts)
    assert outputs(llm, ps) == want
    assert llm.preemptions <= base.preemptions
    idle(llm)


def test_prefix_hits_are_the_same_with_speculation(model):
    """vLLM #42784 (0% prefix hit rate with SWA + Eagle): a second turn hits the first turn's prefix as much as
    without speculation, and decodes the same."""
    p1 = prompts(n=1, seed=7, lo=150, hi=151)[0]
    hits = {}
    for steps in (0, 3):
        llm = engine(model, speculative_steps=steps)
        first = outputs(llm, [p1])[0]
        before = llm.stats()["prefix_hit_tokens"]
        second = outputs(llm, [p1 + first + [5, 6, 7]])[0]
        hits[steps] = (llm.stats()["prefix_hit_tokens"] - before, first, second)
    assert hits[3] == hits[0] and hits[0][0] > 100


def test_the_model_needs_mtp_layers_and_steps_are_bounded(model):
    plain = MiMoV2FlashForCausalLM(replace(CFG, num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="MTP layers"):
        engine(plain, speculative_steps=1)
    with pytest.raises(ValueError, match="has 3 MTP layers"):
        engine(model, speculative_steps=4)


def chi_square_p(table: list[list[int]]) -> float:
    """p-value of Pearson's chi-square test of homogeneity of two rows of counts (bins seen in neither dropped)."""
    cols = [j for j in range(len(table[0])) if table[0][j] + table[1][j] > 0]
    obs = torch.tensor([[row[j] for j in cols] for row in table], dtype=torch.float64)
    expected = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    stat = float(((obs - expected) ** 2 / expected).sum())
    df = len(cols) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_chi_square_p_tells_equal_from_different_distributions():
    assert chi_square_p([[500, 300, 200], [510, 290, 200]]) > 0.5
    assert chi_square_p([[500, 300, 200], [300, 500, 200]]) < 1e-6


def test_sampled_distribution_is_unchanged(model):
    """Temperature 1 with top-k 6: the first three tokens of a fixed prompt, 2000 seeded samples (by default) with and
    without speculation (random MTP drafts: acceptance and residual sampling both happen): a chi-square test
    per position over the token counts."""
    small = replace(
        CFG,
        vocab_size=24,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_attention_heads=2,
        head_dim=16,
        v_head_dim=8,
        num_hidden_layers=2,
        layer_types=[],
        mlp_layer_types=[],
        num_nextn_predict_layers=3,
    )
    small.__post_init__()
    m = MiMoV2FlashForCausalLM(small)
    init_random_weights(m, 3, std=0.5)
    m.eval()
    prompt = [1, 5, 9, 2, 7]
    n = int(os.environ.get("MIMO_EPD_SPEC_SAMPLES", "2000"))
    counts = {}
    for steps in (0, 3):
        llm = engine(
            m, speculative_steps=steps, max_running=n, max_waiting=n, kv_cache_tokens=40000, swa_cache_tokens=40000
        )
        reqs = [
            llm.add_request(prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=s)) for s in range(n)
        ]
        while llm.has_work():
            llm.step()
        counts[steps] = [[r.output[i] for r in reqs] for i in range(3)]
        if steps:
            assert llm.stats()["spec_accepted_tokens"] > 0  # some drafts were accepted, some rejected
    for i in range(3):
        table = [[counts[s][i].count(t) for t in range(small.vocab_size)] for s in (0, 3)]
        assert chi_square_p(table) > 1e-3, (i, table)


def test_speculation_is_deterministic_per_seed(model):
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11)
    ps = prompts(n=2, seed=8)
    a = outputs(engine(model, speculative_steps=3), ps, sp)
    b = outputs(engine(model, speculative_steps=3), ps, sp)
    assert a == b


def test_logprobs_are_the_targets(model):
    ps = prompts(n=2, seed=9)
    sp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True)
    want = engine(model).generate(prompt_token_ids=ps, sampling_params=sp)
    llm = engine(model, speculative_steps=3)
    Oracle({tuple(p): o.output_token_ids for p, o in zip(ps, want)}).install(llm.runner)
    got = llm.generate(prompt_token_ids=ps, sampling_params=sp)
    for a, b in zip(got, want):
        assert a.output_token_ids == b.output_token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def _fed(controller, a, b, c, accept, steps=60, d=0.0):
    """Observations of a machine whose step time is a + b * tokens + c * [verify] + d * drafting requests (8
    decoding requests; verify steps with 8, 1 or 4 of them drafting)."""
    from llm_backend.engine.spec_state import MTPState

    st = MTPState(0, 0, [None])
    for i in range(steps):
        verified = i % 2 == 0
        B = 8
        n = (8, 1, 4)[(i // 2) % 3] if verified else 0
        tokens = B + controller.steps * n + (64 if i % 5 == 0 else 0)
        controller.observe(a + b * tokens + c * verified + d * n, tokens, verified, B, n)
        for _ in range(n):
            controller.accepted(st, accept)
    return st


@pytest.mark.parametrize(
    "costs,accept,drafts",
    [
        ((0.010, 0.00002, 0.001, 0.0002), 2.5, True),  # a GPU-like machine: tokens nearly free, drafts accepted
        ((0.002, 0.004, 0.003, 0.0), 2.5, False),  # a CPU-like machine: every verify token costs a decode step
        ((0.010, 0.00002, 0.001, 0.0002), 0.0, False),  # nothing is ever accepted
        ((0.010, 0.00002, 0.001, 0.004), 2.5, False),  # verify tokens are free, but each drafter costs 3 tokens
    ],
)
def test_the_controller_drafts_only_when_the_measured_costs_pay(costs, accept, drafts):
    from llm_backend.engine.spec_control import SpecController

    ctl = SpecController(3, probe_every=10**9)
    st = _fed(ctl, *costs[:3], accept, d=costs[3])
    a, b, c, d = ctl.costs()
    # the fit recovers the machine's costs, the fixed chain and the per-drafter cost apart
    assert abs(b - costs[1]) < 1e-4 and abs(c - costs[2]) < 1e-3 and abs(d - costs[3]) < 1e-4, ctl.costs()
    assert ctl.wants(st) is drafts


def test_the_margin_keeps_drafting_off_where_it_only_breaks_even():
    """Drafting that saves a little (8 x 0.4 ms against a 32 ms plain step, under the fit's noise on a busy CPU)
    stays off with the default margin (10 % of a plain step) and is on without one; a clear saving is on with it."""
    from llm_backend.engine.spec_control import SpecController

    def decide(margin, accept):
        ctl = SpecController(3, probe_every=10**9, margin=margin)
        return ctl.wants(_fed(ctl, 0.016, 0.002, 0.001, accept))

    assert decide(0.0, 1.6) is True  # saves 8 x (1.6 x 4 ms - 6 ms) = 3.2 ms > the chain's 1 ms
    assert decide(0.1, 1.6) is False  # ... but not 1 ms + 10 % of 32 ms
    assert decide(0.1, 2.5) is True  # 8 x 4 ms = 32 ms saved: on


def test_a_step_of_prompt_chunks_does_not_turn_drafting_on_for_the_batch_after_it():
    """Regression (bench spec, batch 16, 0-128): after a step of 16 prompt chunks (no decoding request) the rule
    priced the next step as one request whose plain token cost the whole prefill step, so all 16 drafted (55 ms
    against 15); it prices the next step's batch (the 16 requests) and a plain decode step (prompt tokens cost the
    same either way)."""
    from llm_backend.engine.spec_control import SpecController

    ctl = SpecController(3, probe_every=10**9)
    st = _fed(ctl, 0.002, 0.004, 0.003, 2.5)  # CPU-like: off
    assert ctl.wants(st) is False
    ctl.observe(0.002 + 0.004 * 480, 480, False, 0, 0, 16)  # 16 prompt chunks of 30 tokens
    assert ctl.wants(st) is False
    ctl.observe(0.002 + 0.004 * 16, 16, False, 16, 0, 16)
    gpu = SpecController(3, probe_every=10**9)
    st = _fed(gpu, 0.010, 0.00002, 0.001, 2.5, d=0.0002)  # GPU-like: on, before and after a prefill step
    assert gpu.wants(st) is True
    gpu.observe(0.010 + 0.00002 * 480, 480, False, 0, 0, 16)
    assert gpu.wants(st) is True


def test_a_probe_of_drafting_drafts_for_a_few_requests_only():
    """With drafting off, a probe lets 1 request draft, the next probe_requests (each drafter first resumes up to W
    deferred rows: a probe of the whole batch of 16 cost several plain steps)."""
    from llm_backend.engine.spec_control import SpecController

    ctl = SpecController(3, probe_every=8, min_steps=2, max_probe_gap=8, probe_requests=4)
    _fed(ctl, 0.002, 0.004, 0.003, 0.5)  # a CPU-like machine: off
    sizes = []
    for _ in range(40):
        n = sum(ctl.wants(type("S", (), {"accept_ema": 0.5})()) for _ in range(16))
        if n:
            sizes.append(n)
        ctl.observe(0.002 + 0.004 * (16 + 3 * n) + 0.003 * (n > 0), 16 + 3 * n, n > 0, 16, n)
    assert sizes[:4] == [1, 4, 1, 4], sizes
    ctl.resumed(128, 0.02)
    assert ctl.as_dict()["resume_ms_per_row"] == pytest.approx(0.1562, abs=1e-3)


def test_the_controller_probes_the_other_choice():
    from llm_backend.engine.spec_control import SpecController

    ctl = SpecController(3, probe_every=4)
    st = _fed(ctl, 0.002, 0.004, 0.003, 0.0)
    choices = []
    for _ in range(8):
        choices.append(ctl.wants(st))
        ctl.observe(0.05, 8, False, 8)
    assert True in choices and False in choices  # off, but every 4th step measures drafting again


def test_the_controller_measures_plain_steps_even_when_every_step_could_draft():
    """Regression (bench spec, batch 16): with every step a verify step the fit never saw a plain one, so the rule
    never applied and drafting stayed on at 0.55x. Until both kinds are measured it alternates them."""
    from llm_backend.engine.spec_control import SpecController

    ctl = SpecController(3, probe_every=10**9, min_steps=4)
    choices = []
    for _ in range(8):
        st = type("S", (), {"accept_ema": None})()
        on = ctl.wants(st)
        choices.append(on)
        ctl.observe(0.002 + 0.004 * (16 * (1 + 3 * on)) + 0.003 * on, 16 * (1 + 3 * on), on, 16)
    assert choices.count(False) == 4 and choices.count(True) == 4, choices
    assert ctl.wants(type("S", (), {"accept_ema": 2.5})()) is False  # CPU-like costs: off once measured


def test_greedy_identical_with_media_rows_and_a_second_turn(model):
    """Image embeddings at placeholder positions (ids >= vocab), then a second turn that hits the first's prefix:
    the MTP layers read the media rows like the target does, outputs equal plain decoding."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    media = {3 + j: torch.randn(model.config.hidden_size, generator=g) * 0.05 for j in range(6)}
    p1 = [5, 6, 7] + [vocab + 100 + j for j in range(6)] + [8, 9, 10, 11]
    got = {}
    for steps in (0, 3):
        llm = engine(model, speculative_steps=steps)
        r1 = llm.add_request(p1, GREEDY, media=dict(media))
        while llm.has_work():
            llm.step()
        p2 = p1 + r1.output + [12, 13]
        r2 = llm.add_request(p2, GREEDY, media=dict(media))
        while llm.has_work():
            llm.step()
        got[steps] = (r1.output, r2.output, r2.cached_tokens)
        idle(llm)
    assert got[3] == got[0] and got[0][2] > 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_outputs_longer_than_the_window_with_rejected_drafts(model, prefix_cache):
    """Regression (found by `bench spec`'s 128-256 bucket): a decode step's out-of-window release ran while the
    request's KV still held its draft positions, so it freed SWA slots that the next step's window (K - accepted
    tokens earlier) still needed: 'a KV slot the window needs was released'. Own decode tokens must pass the
    window (the prompt's slots belong to the tree), with drafts rejected."""
    w = CFG.sliding_window
    ps = prompts(n=3, seed=7, lo=5, hi=40)
    sp = SamplingParams(max_tokens=w + 40, ignore_eos=True)
    want = outputs(engine(model, enable_prefix_cache=prefix_cache), ps, sp)
    llm = engine(model, speculative_steps=3, enable_prefix_cache=prefix_cache)  # random MTP: most drafts rejected
    assert outputs(llm, ps, sp) == want
    s = llm.stats()
    assert s["spec_drafted_tokens"] > s["spec_accepted_tokens"]
    idle(llm)


def scripted(llm, on, log):
    """Replaces the controller's decision with `on(step)` (auto stays as configured: it decides whether plain
    steps defer their catch-up) and logs every drafting request's (id, slot, drafts)."""
    runner, control = llm.runner, llm.runner.control

    def wants(st):
        control._draft_step = on(control.step)
        return control._draft_step

    control.wants = wants
    draft = runner._draft

    def logged(segments):
        draft(segments)
        log.extend((s.request.id, s.start, tuple(runner.states[s.request.id].drafts)) for s in segments)

    runner._draft = logged


def run_scripted(model, ps, sp, on, auto, **kw):
    llm = engine(model, speculative_steps=3, speculative_auto=auto, **kw)
    log: list = []
    scripted(llm, on, log)
    return llm, outputs(llm, ps, sp), log


def test_a_request_that_never_drafts_past_the_window_is_cached_at_its_end(model):
    """Regression (found by `bench spec`'s 128-256 bucket): at the end of a request that deferred past the window,
    the catch-up before caching read SWA slots its first kept entry's window had lost; it failed the whole step."""
    w = CFG.sliding_window
    ps = prompts(n=1, seed=14, lo=5, hi=40)
    sp = SamplingParams(max_tokens=w + 50, ignore_eos=True)
    want = outputs(engine(model, page_size=1), ps, sp)
    llm, got, log = run_scripted(model, ps, sp, lambda step: False, auto=True, page_size=1)
    assert got == want and not log
    s = llm.stats()
    assert s["spec_catch_up_skipped_tokens"] > 0 and s["spec_catch_up_left_stale_tokens"] > 0
    res = llm.generate(prompt_token_ids=[ps[0] + want[0] + [7, 8, 9]], sampling_params=GREEDY)[0]
    assert res.usage.cached_tokens > len(ps[0]) + w  # its whole window was cached
    idle(llm)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_deferred_catch_up_drafts_exactly_what_the_eager_one_drafts(model, prefix_cache):
    """While drafting is off the MTP catch-up waits (`MTPState.pending`) and runs in one pass when drafting
    resumes: every draft after the resume equals the one of a run that caught up on every step (the random MTP
    layers make a draft a sensitive function of their KV), and outputs equal plain decoding."""
    ps = prompts(n=3, seed=11, lo=5, hi=60)
    sp = SamplingParams(max_tokens=70, ignore_eos=True)
    want = outputs(engine(model, enable_prefix_cache=prefix_cache), ps, sp)

    def on(step):
        return not 8 <= step < 50  # off for 42 steps: less than the window, nothing dropped

    eager, got_eager, log_eager = run_scripted(model, ps, sp, on, auto=False, enable_prefix_cache=prefix_cache)
    lazy, got_lazy, log_lazy = run_scripted(model, ps, sp, on, auto=True, enable_prefix_cache=prefix_cache)
    assert got_eager == got_lazy == want
    assert log_lazy == log_eager and any(start > 60 for _, start, _ in log_lazy)  # drafts after the resume too
    s = lazy.stats()
    assert s["spec_catch_up_deferred_tokens"] > 0 and s["spec_catch_up_skipped_tokens"] == 0
    assert eager.stats()["spec_catch_up_deferred_tokens"] == 0
    idle(lazy)


def test_a_long_pause_keeps_only_the_window_and_outputs_stay_identical(model):
    w = CFG.sliding_window
    ps = prompts(n=2, seed=12, lo=5, hi=30)
    sp = SamplingParams(max_tokens=w + 60, ignore_eos=True)
    want = outputs(engine(model), ps, sp)
    llm, got, log = run_scripted(model, ps, sp, lambda step: not 4 <= step < w + 30, auto=True)
    assert got == want
    s = llm.stats()
    assert s["spec_catch_up_skipped_tokens"] > 0  # rows past the window were never computed
    assert any(start > w + 30 for _, start, _ in log)  # and drafting resumed after them
    for r in (*llm.scheduler.running, *llm.scheduler.waiting):
        st = llm.runner.states.get(r.id)
        assert st is None or len(st.pending) <= w
    idle(llm)


def no_stale_reads(llm):
    """Wraps the runner's MTP layer pass: every run's attention (from max(origin, floor) up to its first slot)
    must read no stale slot (one whose MTP entry was never computed)."""
    runner = llm.runner
    run_layer = runner._run_layer
    reads = []

    def checked(layer, runs):
        for u in runs:
            st, kv = runner.states[u.request.id], u.request.kv
            lo = max(st.first_slot(layer), st.floor)
            read = [kv.swa[p] for p in range(lo, u.first)]
            assert not any(runner.swa_pool.is_stale(x) for x in read if x is not None), (
                u.request.id,
                layer,
                lo,
                u.first,
            )
            reads.append((u.request.id, lo))
        run_layer(layer, runs)

    runner._run_layer = checked
    return reads


def test_a_window_whose_mtp_entries_were_deferred_is_cached_stale_and_never_read(model):
    """A first turn that never drafts ends with its catch-up deferred: its KV enters the tree at once (no catch-up
    of up to W rows through every MTP layer), its slots marked stale. A second turn that hits it drafts with MTP
    attention starting after the stale slots (never reading an entry that was not computed), and its output is
    plain decoding's."""
    p = prompts(n=1, seed=13, lo=20, hi=40)[0]
    sp1 = SamplingParams(max_tokens=50, ignore_eos=True)
    sp2 = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = engine(model)
    first_want = outputs(plain, [p], sp1)[0]
    second = p + first_want + [7, 8, 9]
    second_want = outputs(plain, [second], sp2)[0]
    llm = engine(model, speculative_steps=3, speculative_auto=True)
    reads = no_stale_reads(llm)
    log: list = []
    scripted(llm, lambda step: False, log)
    assert outputs(llm, [p], sp1)[0] == first_want and not log
    s = llm.stats()
    assert s["spec_catch_up_left_stale_tokens"] >= 49 and llm.runner.swa_pool.stale_count
    scripted(llm, lambda step: True, log)
    res = llm.generate(prompt_token_ids=[second], sampling_params=sp2)[0]
    assert res.usage.cached_tokens > len(p) and res.output_token_ids == second_want
    assert log and all(start >= len(second) - 1 for _, start, _ in log)  # it drafted
    floors = {lo for rid, lo in reads if rid == res.request_id}
    assert max(floors) >= len(p) + 1  # its MTP attention started past the first turn's stale window
    idle(llm)


def off_from_the_start(llm) -> None:
    """The controller's last decision reads "off" before the first step (a server whose drafting is off), so the
    first prompt chunks defer their catch-up too."""
    llm.runner.control._draft_step = False


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_deferred_prompt_catch_up_drafts_exactly_what_prefill_mtp_drafts(model, prefix_cache):
    """Prefill MTP deferred: while drafting is off a prompt chunk's MTP catch-up waits like a decode token's, and
    when drafting starts the kept rows are caught up first, so every draft equals the one of a run that ran the
    MTP layers over every prompt chunk (prompts shorter than the window: nothing dropped). The prompt's slots were
    marked stale while they waited in the tree (a checkpointed prompt chunk) and are valid again once computed."""
    ps = prompts(n=3, seed=21, lo=70, hi=120)  # two chunks of 64 each
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    want = outputs(engine(model, enable_prefix_cache=prefix_cache), ps, sp)

    def on(step):
        return step >= 6

    eager, got_eager, log_eager = run_scripted(model, ps, sp, on, auto=False, enable_prefix_cache=prefix_cache)
    lazy = engine(model, speculative_steps=3, speculative_auto=True, enable_prefix_cache=prefix_cache)
    log_lazy: list = []
    scripted(lazy, on, log_lazy)
    off_from_the_start(lazy)
    reads = no_stale_reads(lazy)
    got_lazy = outputs(lazy, ps, sp)
    assert got_eager == got_lazy == want
    assert log_lazy == log_eager and log_lazy
    s = lazy.stats()
    assert s["spec_catch_up_deferred_tokens"] >= sum(len(p) for p in ps)  # every prompt row waited
    assert s["spec_catch_up_skipped_tokens"] == 0
    assert s["spec_catch_up_left_stale_tokens"] == 0 and not lazy.runner.swa_pool.stale_count  # all computed
    assert reads
    idle(lazy)


def test_a_long_prompt_deferred_keeps_its_window_and_marks_the_rest_stale(model):
    """A prompt chunk longer than the window, deferred, keeps only its last W rows; the positions before them are
    never computed, yet their slots sit in the tree (the chunk's checkpoint) until decoding releases them, so they
    are marked stale: a request arriving meanwhile that shares a prefix ending among them never reads them (its
    MTP attention starts after them) when it drafts, and both outputs are plain decoding's."""
    w = CFG.sliding_window
    p = prompts(n=1, seed=22, lo=w + 100, hi=w + 101)[0]
    second = p[:90] + [5, 6, 7]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = engine(model, chunk_size=512)
    want = outputs(plain, [p], sp) + outputs(plain, [second], sp)
    llm = engine(model, speculative_steps=3, speculative_auto=True, chunk_size=512)
    reads = no_stale_reads(llm)
    log: list = []
    scripted(llm, lambda step: step >= 1, log)
    off_from_the_start(llm)
    first = llm.add_request(p, sp)
    llm.step()  # the whole prompt in one chunk, its catch-up deferred
    st = llm.runner.states.get(first.id)
    assert st is not None and len(st.pending) == w and st.next_slot == len(p) - w
    assert llm.stats()["spec_catch_up_left_stale_tokens"] >= len(p)  # every prompt slot: cached, not computed
    late = llm.add_request(second, sp)
    while llm.has_work():
        llm.step()
    assert [first.output, late.output] == want
    s = llm.stats()
    assert s["spec_catch_up_skipped_tokens"] == len(p) - w
    assert {rid for rid, _, _ in log} == {first.id, late.id}  # both drafted
    floors = {lo for rid, lo in reads if rid == late.id}
    assert floors and min(floors) >= 88  # its cached prefix (88 tokens, whole pages) was never computed
    idle(llm)


def test_probes_back_off_while_they_confirm_the_decision():
    """A probe with drafting off pays every request's deferred catch-up: probes double their gap while the decision
    holds (32, 64, 128, ... steps), so a long off phase costs a few probes, not one every 32 steps."""
    from llm_backend.engine.spec_control import SpecController

    ctl = SpecController(3, probe_every=32, min_steps=4, max_probe_gap=256)
    st = type("S", (), {"accept_ema": 0.1})()
    probes = []
    for _ in range(1200):
        on = ctl.wants(st)
        if on:
            probes.append(ctl.step)
        ctl.observe(0.002 + 0.004 * (16 * (1 + 3 * on)) + 0.003 * on, 16 * (1 + 3 * on), on, 16)
    gaps = [b - a for a, b in zip(probes[4:], probes[5:])]  # after the first measurements
    assert gaps and gaps[-1] == 256 and gaps == sorted(gaps), probes
    assert len(probes) < 4 + 1200 // 32 // 2


def test_speculation_over_the_host_tier_keeps_stale_windows_stale(model):
    """Speculation composes with the KV tiers: a first turn that never drafted is cached with its window marked
    stale; the tree is then evicted to the host tier. The second turn's hit comes back from the host with its marks
    (kv/pools.py), so its MTP attention still starts past the first turn's window, and both turns' outputs are plain
    decoding's."""
    p = prompts(n=1, seed=13, lo=20, hi=40)[0]
    sp1 = SamplingParams(max_tokens=50, ignore_eos=True)
    sp2 = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = engine(model)
    first_want = outputs(plain, [p], sp1)[0]
    second = p + first_want + [7, 8, 9]
    second_want = outputs(plain, [second], sp2)[0]
    llm = engine(model, speculative_steps=3, speculative_auto=True, host_kv_bytes=10**7)
    log: list = []
    scripted(llm, lambda step: False, log)
    assert outputs(llm, [p], sp1)[0] == first_want and not log
    assert llm.runner.swa_pool.stale_count
    llm.cache.evict_full(10**9)  # the whole tree to the host: the device slots and their marks are freed
    assert llm.runner.swa_pool.stale_count == 0 and llm.tiers.host_swa.stale_count
    reads = no_stale_reads(llm)
    scripted(llm, lambda step: True, log)
    res = llm.generate(prompt_token_ids=[second], sampling_params=sp2)[0]
    assert res.output_token_ids == second_want
    assert llm.stats()["kv_tier_hit_host"] > len(p) and res.usage.cached_tokens > len(p)  # from the host
    assert log and all(start >= len(second) - 1 for _, start, _ in log)  # it drafted
    floors = {lo for rid, lo in reads if rid == res.request_id}
    assert max(floors) >= len(p) + 1  # past the first turn's stale window, restored from the host
    idle(llm)


def test_speculation_over_the_shared_store_between_two_workers(model, redis_server):  # noqa: F811
    """Speculation composes with the shared KV store (Redis here): worker A, drafting, writes its pages (prompt
    chunks longer than the window, so its inserted pages carry their window and MTP layers' KV); worker B, a fresh
    tree, loads them and drafts from the store's KV: both give plain decoding's tokens, B's prompts come from the
    store, and no page is corrupt."""
    ps = prompts(n=3, seed=21, lo=200, hi=260)
    want = outputs(engine(model), ps)
    kw = dict(speculative_steps=3, kv_store=redis_server.url, kv_store_write="insert", chunk_size=256)
    a = engine(model, **kw)
    assert outputs(a, ps) == want and a.stats()["spec_drafted_tokens"] > 0
    a.tiers.store.flush()
    b = engine(model, **kw)
    assert outputs(b, ps) == want
    s = b.stats()
    assert s["kv_store_hits"] > 0 and s["kv_store_corrupt"] == 0 and s["spec_drafted_tokens"] > 0
    idle(a)
    idle(b)
