"""`mimo-epd bench pd-live`: prefill/decode disaggregation with live workers on this machine (the default model).

Two fleets, the same multi-turn workload (S sessions of T turns; each turn's prompt is the previous prompt, its
answer and new tokens; the sessions run concurrently, turns one after another; greedy):
- `colocated`: 2 `both` workers, each session pinned to one (what KV-affinity routing does with sessions);
- `disaggregated`: 1 prefill worker + 1 decode worker, every request to the decode worker.
Reported: whether every output is equal across the two, TTFT and ITL P50/P90 as the client sees them, the KV bytes
transferred per request as the decode worker measured them and from the rule (llm_backend/pd/rule.py) with its
decode-side prefix, and the transfer's share of TTFT. It reports; it does not grade.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="model (default: tiny)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default: 4)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default: 3)")
    p.add_argument("--prompt-tokens", type=int, default=400, help="first turn's prompt tokens (default: 400)")
    p.add_argument("--turn-tokens", type=int, default=40, help="new tokens per later turn (default: 40)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn (default: 16)")


def log(msg: str) -> None:
    print(f"[bench pd-live] {msg}", file=sys.stderr, flush=True)


def _pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))], 5)


def _stream(address: str, ids: list[int], n: int):
    import grpc

    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    req = generator_pb2.GenerateRequest(
        prompt_token_ids=ids, sampling=generator_pb2.SamplingOptions(max_tokens=n, ignore_eos=True)
    )
    t0 = time.monotonic()
    times, tokens, final = [], [], None
    for msg in stub.Generate(req, timeout=600):
        if msg.HasField("delta") and msg.delta.token_ids:
            times.append(time.monotonic())
            tokens += list(msg.delta.token_ids)
        elif msg.HasField("final"):
            final = msg.final
    return tokens, times[0] - t0 if times else 0.0, [b - a for a, b in zip(times, times[1:])], final


def _session(address: str, s: int, args) -> list:
    ids = [1] + [(37 * s + 11 * i) % 250 + 3 for i in range(args.prompt_tokens)]
    out = []
    for t in range(args.turns):
        tokens, ttft, itl, final = _stream(address, ids, args.max_tokens)
        out.append((list(ids), tokens, ttft, itl, final))
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
    return {
        "requests": len(flat),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p90_s": _pct(ttft, 0.9),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p90_s": _pct(itl, 0.9),
    }


def main(args) -> dict:
    from llm_backend.models import load_llm
    from llm_backend.paged_attention import KVPools
    from llm_backend.pd.rule import TransferRule
    from llm_backend.pd.transfer import PoolLayout
    from mimo_epd.testing.servers import start_server

    common = ["--model", args.model, "--torch-threads", "1", "--http-port", "-1"]
    servers = []
    try:
        log("colocated: 2 both workers")
        servers = [start_server(common, "llm"), start_server(common, "llm")]
        colocated = _run([s.address for s in servers], args)
        for s in servers:
            s.stop()
        log("disaggregated: 1 prefill + 1 decode worker")
        pre = start_server(common + ["--role", "prefill"], "llm")
        servers = [pre]
        dec = start_server(
            common + ["--role", "decode", "--pd-prefill", pre.address, "--pd-local-prefill-tokens", "0"], "llm"
        )
        servers.append(dec)
        disagg = _run([dec.address], args)
    finally:
        for s in servers:
            s.stop()
    cfg = load_llm(args.model).config
    full_b, swa_b = PoolLayout.of(KVPools(cfg, 1, 1)).token_bytes()
    measured, formula, shares = [], [], []
    for sess in disagg:
        for ids, _, _, _, final in sess:
            measured.append(final.kv_transfer_bytes)
            formula.append(TransferRule(len(ids), final.cached_tokens, cfg.window, 1).bytes(full_b, swa_b))
            if final.ttft_ms > 0:
                shares.append(final.kv_transfer_ms / final.ttft_ms)
    equal = [a[1] == b[1] for sa, sb in zip(colocated, disagg) for a, b in zip(sa, sb)]
    col, dis = _summary(colocated), _summary(disagg)
    first = [f[4].kv_transfer_bytes for f in (s[0] for s in disagg)]
    later = [x[4].kv_transfer_bytes for s in disagg for x in s[1:]]
    return {
        "benchmark": "pd-live",
        "model": args.model,
        "workload": {
            "sessions": args.sessions,
            "turns": args.turns,
            "prompt_tokens": args.prompt_tokens,
            "turn_tokens": args.turn_tokens,
            "max_tokens": args.max_tokens,
            "greedy": True,
        },
        "modes": {
            "colocated": {"workers": "2 both (sessions pinned)", **col},
            "disaggregated": {
                "workers": "1 prefill + 1 decode",
                **dis,
                "transfer_bytes_per_request_measured": sum(measured) / max(1, len(measured)),
                "transfer_bytes_per_request_formula": sum(formula) / max(1, len(formula)),
                "transfer_bytes_first_turn_mean": sum(first) / max(1, len(first)),
                "transfer_bytes_later_turns_mean": sum(later) / max(1, len(later)),
                "transfer_share_of_ttft_p50": _pct(shares, 0.5),
            },
        },
        "outputs_equal": all(equal),
        "ratios": {
            "outputs_equal": all(equal),
            "transfer_bytes_vs_formula": round(sum(measured) / max(1, sum(formula)), 4),
            "ttft_p50_disagg_vs_colocated": round(dis["ttft_p50_s"] / max(col["ttft_p50_s"], 1e-9), 3),
            "itl_p50_disagg_vs_colocated": round(dis["itl_p50_s"] / max(col["itl_p50_s"], 1e-9), 3),
        },
    }
