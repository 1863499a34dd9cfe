"""`mimo-epd bench pd-live`: prefill/decode disaggregation with live workers on this machine (the default model).

Two `mimo-epd serve` nodes, one after the other, the same multi-turn workload through each node's router (S
sessions of T turns; each turn's prompt is the previous prompt, its answer and new tokens; the sessions run
concurrently, turns one after another; greedy):
- `colocated`: `--llm-workers 2` (two `both` workers, KV-affinity routing);
- `disaggregated`: `--llm-workers 0 --pd-prefill-workers 1 --pd-decode-workers 1` (the router picks the prefill
  worker of each request; every prompt is prefilled remotely: `--llm-pd-local-prefill-tokens -1`);
- with `--speculative-steps K`, also `disaggregated_speculative`: the same node with `--llm-speculative-steps K`
  on both roles (the MTP layers' KV moves with the rest, docs/pd.md).
Decode tokens/s per mode: tokens after each request's first message over the time from it to the last one.
Reported: whether every output is equal across the two, TTFT and ITL P50/P90 as the client sees them, the KV bytes
transferred per request as the decode worker measured them and from the rule (llm_backend/pd/rule.py) with its
decode-side prefix, and the transfer's share of TTFT. It reports; it does not grade.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from mimo_epd.common.stats import percentile


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="model (default: tiny)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default: 4)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default: 3)")
    p.add_argument("--prompt-tokens", type=int, default=400, help="first turn's prompt tokens (default: 400)")
    p.add_argument("--turn-tokens", type=int, default=40, help="new tokens per later turn (default: 40)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn (default: 16)")
    p.add_argument(
        "--speculative-steps",
        type=int,
        default=0,
        help="also run P/D with MTP speculation on both roles, K draft tokens per step (default: 0 = not run)",
    )


def log(msg: str) -> None:
    print(f"[bench pd-live] {msg}", file=sys.stderr, flush=True)


def _stream(address: str, ids: list[int], n: int):
    import grpc

    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    req = generator_pb2.GenerateRequest(
        prompt_token_ids=ids, sampling=generator_pb2.SamplingOptions(max_tokens=n, ignore_eos=True)
    )
    t0 = time.monotonic()
    times, tokens, final, first = [], [], None, 0
    for msg in stub.Generate(req, timeout=600):
        if msg.HasField("delta") and msg.delta.token_ids:
            times.append(time.monotonic())
            tokens += list(msg.delta.token_ids)
            first = first or len(tokens)
        elif msg.HasField("final"):
            final = msg.final
    decode = (len(tokens) - first, times[-1] - times[0] if times else 0.0)  # after the first message
    return tokens, times[0] - t0 if times else 0.0, [b - a for a, b in zip(times, times[1:])], final, decode


def _session(address: str, s: int, args) -> list:
    ids = [1] + [(37 * s + 11 * i) % 250 + 3 for i in range(args.prompt_tokens)]
    out = []
    for t in range(args.turns):
        tokens, ttft, itl, final, decode = _stream(address, ids, args.max_tokens)
        out.append((list(ids), tokens, ttft, itl, final, decode))
        ids = ids + tokens + [(13 * s + 7 * t + 5 * i) % 250 + 3 for i in range(args.turn_tokens)]
    return out


def _run(addresses: list[str], args) -> list:
    with ThreadPoolExecutor(args.sessions) as pool:
        futs = [pool.submit(_session, addresses[s % len(addresses)], s, args) for s in range(args.sessions)]
        return [f.result() for f in futs]


def _summary(runs) -> dict:
    flat = [x for sess in runs for x in sess]
    ttft = [x[2] for x in flat]
    itl = [g for x in flat for g in x[3]]
    decoded = sum(x[5][0] for x in flat)
    decode_s = sum(x[5][1] for x in flat)
    return {
        "requests": len(flat),
        "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s else 0.0,
        "ttft_p50_s": percentile(ttft, 50, 5),
        "ttft_p90_s": percentile(ttft, 90, 5),
        "itl_p50_s": percentile(itl, 50, 5),
        "itl_p90_s": percentile(itl, 90, 5),
    }


def _bytes_rule(model, runs, speculative: bool) -> tuple[list[int], list[int], list[float]]:
    """(measured bytes, the rule's bytes, transfer share of TTFT) per request of a disaggregated run; the rule over
    the pools of the run (with the MTP layers' when it speculated)."""
    from llm_backend.kv.transfer import PoolLayout
    from llm_backend.paged_attention import KVPools
    from llm_backend.pd.rule import TransferRule

    cfg = model.config
    pools = KVPools(cfg, 1, 1)
    if speculative:
        pools.add_sliding_layers(model.model.mtp.kv_config(), 1)
    full_b, swa_b = PoolLayout.of(pools).token_bytes()
    measured, formula, shares = [], [], []
    for sess in runs:
        for ids, _, _, _, final, _ in sess:
            measured.append(final.kv_transfer_bytes)
            formula.append(TransferRule(len(ids), final.cached_tokens, cfg.window, 1).bytes(full_b, swa_b))
            if final.ttft_ms > 0:
                shares.append(final.kv_transfer_ms / final.ttft_ms)
    return measured, formula, shares


def _disagg_mode(model, runs, workers: str, speculative: bool) -> dict:
    measured, formula, shares = _bytes_rule(model, runs, speculative)
    first = [s[0][4].kv_transfer_bytes for s in runs]
    later = [x[4].kv_transfer_bytes for s in runs for x in s[1:]]
    accepted = sum(x[4].accepted_prediction_tokens for s in runs for x in s)
    return {
        "workers": workers,
        **_summary(runs),
        "transfer_bytes_per_request_measured": sum(measured) / max(1, len(measured)),
        "transfer_bytes_per_request_formula": sum(formula) / max(1, len(formula)),
        "transfer_bytes_vs_formula": round(sum(measured) / max(1, sum(formula)), 4),
        "transfer_bytes_first_turn_mean": sum(first) / max(1, len(first)),
        "transfer_bytes_later_turns_mean": sum(later) / max(1, len(later)),
        "transfer_share_of_ttft_p50": percentile(shares, 50, 5),
        "accepted_draft_tokens": accepted,
    }


def main(args) -> dict:
    from llm_backend.models import load_llm
    from mimo_epd.testing.servers import start_server

    common = ["--llm-model", args.model, "--http-port", "-1", "--llm-torch-threads", "1"]
    pd_node = ["--llm-workers", "0", "--pd-prefill-workers", "1", "--pd-decode-workers", "1"]
    pd_node += ["--llm-pd-local-prefill-tokens", "-1"]
    spec = ["--llm-speculative-steps", str(args.speculative_steps), "--no-llm-speculative-auto"]
    modes = [("colocated", ["--llm-workers", "2"]), ("disaggregated", pd_node)]
    if args.speculative_steps:
        modes.append(("disaggregated_speculative", pd_node + spec))
    runs: dict = {}
    for name, flags in modes:
        log(f"{name}: serve {' '.join(flags)}")
        node = start_server(common + flags, "serve", timeout=600)
        try:
            runs[name] = _run([node.address], args)
        finally:
            node.stop()
    model = load_llm(args.model)
    colocated = runs["colocated"]
    col = {"workers": "serve --llm-workers 2", **_summary(colocated)}
    out_modes = {"colocated": col}
    for name, flags in modes[1:]:
        out_modes[name] = _disagg_mode(model, runs[name], "serve " + " ".join(flags), name.endswith("speculative"))
    equal = {name: all(a[1] == b[1] for sa, sb in zip(colocated, runs[name]) for a, b in zip(sa, sb)) for name in runs}
    dis = out_modes["disaggregated"]
    ratios = {
        "outputs_equal": all(equal.values()),
        "transfer_bytes_vs_formula": dis["transfer_bytes_vs_formula"],
        "ttft_p50_disagg_vs_colocated": round(dis["ttft_p50_s"] / max(col["ttft_p50_s"], 1e-9), 3),
        "itl_p50_disagg_vs_colocated": round(dis["itl_p50_s"] / max(col["itl_p50_s"], 1e-9), 3),
    }
    if "disaggregated_speculative" in out_modes:
        sp = out_modes["disaggregated_speculative"]
        ratios["decode_tokens_per_s_speculative_vs_plain_disagg"] = round(
            sp["decode_tokens_per_s"] / max(dis["decode_tokens_per_s"], 1e-9), 3
        )
        ratios["transfer_bytes_speculative_vs_plain_disagg"] = round(
            sp["transfer_bytes_per_request_measured"] / max(dis["transfer_bytes_per_request_measured"], 1e-9), 3
        )
    return {
        "benchmark": "pd-live",
        "model": args.model,
        "workload": {
            "sessions": args.sessions,
            "turns": args.turns,
            "prompt_tokens": args.prompt_tokens,
            "turn_tokens": args.turn_tokens,
            "max_tokens": args.max_tokens,
            "speculative_steps": args.speculative_steps,
            "greedy": True,
        },
        "modes": out_modes,
        "outputs_equal": equal,
        "ratios": ratios,
    }
