"""Data-parallel attention (llm_backend/parallel/data.py): DP ranks as real worker processes on gloo, against our
one-rank engine (no outside reference exists for it: the one-rank, colocated engine's greedy tokens are the truth).

- the rules and refusals, by name, without processes;
- two DP ranks with different loads (one prefills and decodes three prompts, the other one long generation, so
  the ranks' steps differ and shadow rounds happen): each rank's greedy tokens equal one rank's, with a prefix-cache
  hit, media rows and MTP speculation; each rank holds half of the experts (measured on its tensors);
- `mimo-epd llm --dp 2` as two real worker processes: the OpenAI API on each answers as one worker does, /metrics
  shows the DP group; SIGKILL of one DP rank fails the other's request with a clear error and it exits with
  status 1 within the collective timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llm_backend import LLM, SamplingParams
from llm_backend.config import LLMConfig
from llm_backend.models import model_config
from llm_backend.models.make_checkpoint import write_checkpoint
from llm_backend.parallel.data import moe_layers
from llm_backend.parallel.replica import free_init_method
from llm_backend.parallel.shard import Shard

GREEDY = SamplingParams(max_tokens=10, temperature=0)
LONG = SamplingParams(max_tokens=40, temperature=0)
OPTS = dict(kv_cache_tokens=1024, swa_cache_tokens=1024, chunk_size=32, torch_threads=1, max_running=4)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 5, list(range(20, 90)), [3, 4, 5]]
DP = dict(data_parallel_size=2, enable_expert_parallel=True)


# ------------------------------------------------------------------------------------------- rules, no processes


def test_experts_split_over_every_rank_of_every_dp_rank():
    assert [Shard(0, 1, True, d, 2).experts(8) for d in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [Shard(r, 2, True, d, 2).experts(8) for d in range(2) for r in range(2)] == [
        slice(0, 2),
        slice(2, 4),
        slice(4, 6),
        slice(6, 8),
    ]
    dp = Shard(0, 1, True, 1, 2)
    assert not dp.single and dp.size == 1  # attention whole, experts split
    from llm_backend.models import TINY_LLM_CONFIG

    assert dp.attention_config(TINY_LLM_CONFIG) is TINY_LLM_CONFIG
    assert dp.cuts("model.layers.1.mlp.experts.down_proj", (8, 256, 64), TINY_LLM_CONFIG) == {0: [slice(4, 8)]}
    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) is not a multiple of 3"):
        Shard(0, 1, True, 0, 3).check(TINY_LLM_CONFIG)
    with pytest.raises(ValueError, match="needs --enable-expert-parallel"):
        Shard(0, 1, False, 0, 2).check(TINY_LLM_CONFIG)


@pytest.mark.parametrize(
    "option, says",
    [
        (dict(enable_expert_parallel=False), "needs --enable-expert-parallel"),
        (dict(dist_init_addr=""), "needs --dist-init-addr"),
        (dict(data_parallel_dispatch="broadcast"), "--data-parallel-dispatch must be"),
        (dict(data_parallel_poll_ms=30), "--data-parallel-poll-ms <= --data-parallel-idle-poll-ms"),
        (dict(data_parallel_rank=2), "--data-parallel-rank 2"),
    ],
)
def test_what_data_parallelism_cannot_do_is_refused_by_name(option, says):
    opts = {**DP, "dist_init_addr": "127.0.0.1:29999", **option}
    with pytest.raises(ValueError, match=says):
        LLMConfig(**opts).validate()


def test_serve_makes_its_llm_workers_the_dp_ranks():
    """`serve --llm-data-parallel-size 2` starts two LLM workers (DP ranks 0 and 1, one meeting address); another
    worker count, or P/D workers beside them, is refused by name."""
    from mimo_epd.cli import build_parser
    from mimo_epd.launcher.config import NodeConfig
    from mimo_epd.launcher.node import data_parallel_args

    def node(*flags):
        return NodeConfig.from_args(build_parser().parse_args(["serve", *flags]))

    dp = node("--llm-data-parallel-size", "2", "--llm-enable-expert-parallel")
    assert dp.llm_workers == 2 and "--data-parallel-size" in dp.llm_args
    own = data_parallel_args(dp)
    assert [a[:2] for a in own] == [["--data-parallel-rank", "0"], ["--data-parallel-rank", "1"]]
    assert own[0][2:] == own[1][2:] and own[0][2] == "--dist-init-addr"
    given = node("--llm-dp", "2", "--llm-enable-expert-parallel", "--llm-dist-init-addr", "10.0.0.1:29500")
    assert [a[2:] for a in data_parallel_args(given)] == [[], []]  # the user's address, in the passed-through flags
    gpus = node("--llm-dp", "2", "--llm-enable-expert-parallel", "--llm-device", "cuda", "--llm-tp", "4")
    assert [a[-2:] for a in data_parallel_args(gpus)] == [["--device", "cuda:0"], ["--device", "cuda:4"]]
    from llm_backend.parallel.replica import RankSpec

    spec = RankSpec("m", "bfloat16", "cuda:4", "keep", "", 4, True, 8, 8, "tcp://x:1", 1.0, 1.0)
    assert [spec.device_of(r) for r in range(4)] == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]
    with pytest.raises(ValueError, match="needs --llm-workers 2 \\(got 3\\)"):
        node("--llm-data-parallel-size", "2", "--llm-workers", "3")
    with pytest.raises(ValueError, match="no P/D workers"):
        node(
            "--llm-data-parallel-size",
            "2",
            "--llm-workers",
            "2",
            "--pd-prefill-workers",
            "1",
            "--pd-decode-workers",
            "1",
        )


# ------------------------------------------------------------------------------------------- real DP ranks


def _rank(rank: int, addr: str, spec: bool, tp: int, dispatch: str, model: str, out) -> None:
    """One DP rank (a spawned process): rank 0 runs three prompts, again (prefix hits), and a media prompt; rank 1
    one long generation. Offline, `generate` is collective: every DP rank makes the same calls (an empty one where
    it has nothing: it steps with the others until none has work). Sends back its outputs, stats and the expert
    rows it holds."""
    llm = LLM(
        model,
        data_parallel_rank=rank,
        dist_init_addr=addr,
        tensor_parallel_size=tp,
        data_parallel_dispatch=dispatch,
        **DP,
        **_opts(model),
        **_spec(spec),
    )
    try:
        if rank == 0:
            got = [_run(llm, PROMPTS, GREEDY), _run(llm, PROMPTS, GREEDY), _run_media(llm)]
        else:
            got = [_run(llm, PROMPTS[1:2], LONG), _run(llm, [], GREEDY), _run(llm, [], GREEDY)][:1]
        experts = sum(m.experts.down_proj.shape[0] for m in moe_layers(llm.model).values())
        out.put((rank, got, llm.stats(), experts))
    finally:
        llm.close()


def _opts(model: str) -> dict:
    """A released FP8 checkpoint keeps its FP8 experts, cut whole with their block scales."""
    return {**OPTS, "fp8_weights": "keep"} if model != "tiny" else OPTS


def _spec(on: bool) -> dict:
    return dict(speculative_steps=3, speculative_auto=False) if on else {}


def _run(llm: LLM, prompts, params):
    return [o.output_token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def _run_media(llm: LLM):
    """A prompt with six media rows (seeded), through the serving path's `add_request`; DP ranks step together
    (`generate` with no prompts of its own runs until every rank is done)."""
    vocab, hidden = llm.model.config.vocab_size, llm.model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    media = {3 + j: torch.randn(hidden, generator=g) * 0.05 for j in range(6)}
    r = llm.add_request([5, 6, 7] + [vocab + 100 + j for j in range(6)] + [8, 9, 10, 11], GREEDY, media=media)
    if llm.data is not None:
        llm.generate(prompt_token_ids=[], sampling_params=GREEDY)
    while llm.has_work():
        llm.step()
    return [r.output]


def _reference(spec: bool, model: str):
    llm = LLM(model, **_opts(model), **_spec(spec))
    first = _run(llm, PROMPTS, GREEDY)
    return [first, _run(llm, PROMPTS, GREEDY), _run_media(llm)], [_run(llm, PROMPTS[1:2], LONG)]


@pytest.fixture(scope="module")
def v25(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("v25") / "v2.5-fp8")
    write_checkpoint(d, "v2.5", "fp8")  # the released layout: fused QKV pre-split for 4 ranks, 128x128 FP8 blocks
    return d


@pytest.mark.parametrize(
    "spec, tp, dispatch, released",
    [
        (False, 1, "all_to_all", False),
        (True, 1, "all_to_all", False),
        (False, 2, "all_to_all", False),
        (False, 2, "all_gather", False),
        (False, 1, "all_to_all", True),
    ],
    ids=["plain", "mtp", "tp2-plain", "tp2-all-gather", "v2.5-fp8"],  # (MTP's layers are dense: nothing TP-specific)
)
def test_dp2_ranks_with_different_loads_each_equal_one_rank(request, spec, tp, dispatch, released):
    """DP 2, and DP 2 x TP 2 (attention split inside each DP rank: four processes, the experts over all four); the
    tokens dispatched to their experts' ranks and back (all-to-all), or gathered everywhere and the sums
    all-reduced; and V2.5 in its released FP8 layout, its FP8 experts kept and cut whole with their scales."""
    model = request.getfixturevalue("v25") if released else "tiny"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_init_method().removeprefix("tcp://")
    procs = [ctx.Process(target=_rank, args=(r, addr, spec, tp, dispatch, model, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {r: (outputs, stats, experts) for r, outputs, stats, experts in (out.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    want0, want1 = _reference(spec, model)
    assert got[0][0] == want0 and got[1][0] == want1
    s0, s1 = got[0][1], got[1][1]
    assert s0["prefix_hit_tokens"] > 0  # the second pass hit the cache
    assert s0["dp_shadow_rounds"] > 0 and s1["dp_shadow_rounds"] > 0  # each answered the other's forwards
    assert s0["dp_rounds"] != s1["dp_rounds"]  # the loads differed
    cfg = model_config(model)
    sparse, k = cfg.mlp_layer_types.count("sparse"), cfg.num_experts_per_tok
    for st in (s0, s1):  # each DP rank counts its own tokens' routing: k pairs a token a layer, on every expert rank
        assert sum(st["ep_expert_tokens"]) % (k * sparse) == 0 and len(st["ep_tokens_per_rank"]) == 2 * tp
        assert st["dp_expert_rows"] > 0 and st["dp_sent_rows"] > 0
    assert s0["ep_expert_tokens"] != s1["ep_expert_tokens"]  # the loads differed
    assert got[0][2] == got[1][2] == sparse * cfg.n_routed_experts // (2 * tp)  # each DP rank's rank 0: its share
    if spec:
        assert s0["spec_accepted_tokens"] > 0 and s1["spec_accepted_tokens"] > 0


@pytest.mark.integration
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_dp2_workers_serve_the_openai_api_and_fail_loudly_when_one_dies(how, one_worker):
    """Two `mimo-epd llm` processes with --dp 2: each answers the OpenAI client as a one-rank worker does; SIGKILL
    (dead: at once) or SIGSTOP (hung: within --dist-timeout-s) of DP rank 1 during a long request on rank 0 gives
    that request a clear error, and rank 0 exits with status 1 (its supervisor restarts the group)."""
    import openai

    from mimo_epd.testing.servers import scrape, start_server

    ask, want = one_worker
    base = ["--model", "tiny", "--http-port", "0", "--torch-threads", "1"]
    addr = free_init_method().removeprefix("tcp://")
    dp = ["--dp", "2", "--enable-expert-parallel", "--dist-init-addr", addr, "--dist-timeout-s", "5"]
    with ThreadPoolExecutor(2) as pool:
        workers = list(pool.map(lambda r: start_server([*base, *dp, "--data-parallel-rank", str(r)], "llm"), [0, 1]))
    try:
        clients = [openai.OpenAI(base_url=f"http://{w.http_address}/v1", api_key="x", max_retries=0) for w in workers]
        for c in clients:
            assert c.completions.create(**ask).choices[0].text == want.choices[0].text
        m = scrape(int(workers[1].http_address.rsplit(":", 1)[1]))
        assert m["llm_data_parallel_size"] == 2 and m["llm_data_parallel_rank"] == 1 and m["llm_dp_up"] == 1
        assert m["llm_dp_rounds_total"] > 0 and m["llm_dp_shadow_rounds_total"] > 0
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(clients[0].completions.create, **{**ask, "max_tokens": 2000})
            time.sleep(1.0)
            workers[1].proc.send_signal(getattr(signal, how))
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as err:
                pending.result(timeout=60)
        assert err.value.status_code == 503 and "data-parallel group down" in str(err.value)
        assert workers[0].proc.wait(timeout=30) == 1
        assert time.monotonic() - t0 < 30  # the timeout is 5 s: never a hang
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
                w.proc.kill()


@pytest.mark.integration
def test_serve_runs_its_llm_workers_as_one_dp_group_and_restarts_it_whole(one_worker):
    """`mimo-epd serve --llm-data-parallel-size 2`: the node's two LLM workers are DP ranks 0 and 1 (the router sees
    two workers); completions equal a one-rank worker's. SIGKILL of DP rank 1 takes rank 0 down too; the supervisor
    restarts both, they meet again at the node's address, and the node answers the same again."""
    import openai
    import psutil

    from mimo_epd.testing.servers import start_server

    ask, want = one_worker
    dp = ["--llm-data-parallel-size", "2", "--llm-enable-expert-parallel", "--llm-dist-timeout-s", "5"]
    node = start_server(["--http-port", "0", "--encoders", "1", *dp], "serve", timeout=300)
    try:
        c = openai.OpenAI(base_url=f"http://{node.http_address}/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(2):
            assert c.completions.create(**ask).choices[0].text == want.choices[0].text
        ranks = {}
        for p in psutil.Process(node.proc.pid).children(recursive=True):
            line = p.cmdline()
            if "--data-parallel-rank" in line:
                ranks[line[line.index("--data-parallel-rank") + 1]] = p
        assert sorted(ranks) == ["0", "1"] and "--dist-init-addr" in ranks["0"].cmdline()
        ranks["1"].kill()
        ranks["0"].wait(timeout=30)  # the group is down: rank 0 leaves too (psutil: no exit code of a grandchild)
        deadline, answer = time.monotonic() + 120, None
        while time.monotonic() < deadline and answer is None:
            try:
                answer = c.completions.create(**ask).choices[0].text
            except openai.APIError:
                time.sleep(1)
        assert answer == want.choices[0].text, "the restarted DP group serves again"
    finally:
        node.stop()
