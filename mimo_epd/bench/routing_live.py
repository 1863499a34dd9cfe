"""`mimo-epd bench routing-live`: the LLM router's policies on live workers, and the real SGLang gateway beside them.

Setup per run, fresh each time (cold caches, the same start for everyone): two `mimo-epd llm` workers (tiny model,
HTTP API on), and in front of them either a `mimo-epd router --http-port` with one policy (the same LLMRouter and
HTTP front `mimo-epd serve --llm-workers 2` runs in its own process; serve adds only its encoders, which a text
workload never calls), or SGLang's gateway (PyPI `sglang-router`, `python -m sglang_router.launch_router
--worker-urls ... --policy cache_aware`) talking to the workers' SGLang-compatible HTTP API.

Workload (deterministic, the same requests for every run): S sessions x T turns of chat, each session on one of a
few shared system prompts; turn t carries the session's whole conversation so far, with the assistant's earlier
replies replayed from the script (so every run sends byte-identical requests whatever the model answered). C
clients each take the next session and send its turns in order (closed loop). Every request is a streamed chat
completion, greedy, `ignore_eos`, the same `max_tokens`, with the usage (cached tokens) asked for.

Per run: the cached-token fraction (cached / prompt tokens, from the workers' usage), client TTFT P50 / P90, QPS,
the router's prediction error (its /metrics: mean |reported - predicted| cached tokens, exact share; not for the
gateway, which predicts nothing it reports), and the load imbalance over the workers (max / mean of requests and
of busy time = the sum of their requests' latencies, from each worker's own /metrics). Every run's texts are
compared with the affinity run's, request by request. After the workload, `front_overhead` times the front
alone: the median TTFT of sequential one-token requests with one short prompt, straight to a worker and through
the front. `ratios` are ours / the other's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mimo_epd.common.stats import percentile
from mimo_epd.testing.redis_server import free_port
from mimo_epd.testing.servers import scrape, start_server

POLICIES = ("affinity", "round_robin", "least_load", "cache_aware", "kv_cost")
GATEWAY_VERSION = "0.3.2"  # the dev extra's pin (pyproject.toml)

SYSTEM_PROMPTS = (
    "You are the help desk of a regional railway. Give departure times in 24-hour format, name the platform when "
    "it is known, mention step-free access, and say plainly when a connection is not guaranteed. Keep answers to "
    "two or three sentences and never promise refunds; point to the refund form instead.",
    "You are a kitchen assistant for a small restaurant. Scale recipes on request, convert between grams and cups, "
    "flag the fourteen common allergens whenever an ingredient contains one, and suggest a substitute for any "
    "ingredient that is out of season. Answer in short numbered steps.",
    "You are a reviewer of shell scripts. Point out unquoted variables, missing `set -euo pipefail`, commands that "
    "fail on file names with spaces and any use of `rm -rf` with a variable path. Quote the offending line, then "
    "give the corrected line, and nothing else.",
    "You are a tutor for first-year statistics. Explain with one small worked example, state the assumptions of "
    "every test you mention, and prefer confidence intervals to bare p-values. Ask one check question at the end "
    "of each answer.",
)
QUESTIONS = (
    "How do I start?",
    "What is the most common mistake here?",
    "Can you give a concrete example?",
    "What changes if the input is twice as large?",
    "Which option would you pick, and why?",
    "How would I check that it worked?",
    "What should I avoid?",
    "Summarise the steps in one line.",
)
REPLIES = (
    "Start with the smallest case and write down what you expect before you run anything.",
    "Most people skip the check of the inputs; look at the first and last rows before anything else.",
    "Take three items, apply the rule to each in turn, and compare the totals with the expected ones.",
    "Roughly twice the work, but the steps stay the same; only the final check needs a larger sample.",
    "The second one: it is slower to set up but much easier to verify afterwards.",
    "Repeat the run on a copy and compare the two outputs line by line; they should be identical.",
    "Avoid changing two things at once, and never trust a result you cannot reproduce.",
    "Check the inputs, apply the rule, verify on a copy, then write it down.",
)


# ---------------------------------------------------------------------------------------------- workload
def workload(sessions: int, turns: int, prompts: int = len(SYSTEM_PROMPTS), tag: str = "") -> list[list[list[dict]]]:
    """sessions x turns chat requests (each a `messages` list), deterministic. A `tag` opens every system prompt
    (runs with different tags share no prefix beyond the template's first bytes: --quick's runs share workers)."""
    out = []
    for s in range(sessions):
        system = SYSTEM_PROMPTS[s % max(1, min(prompts, len(SYSTEM_PROMPTS)))]
        msgs = [{"role": "system", "content": f"[{tag}] {system}" if tag else system}]
        session = []
        for t in range(turns):
            k = (s * 5 + t * 3) % len(QUESTIONS)
            msgs = [*msgs, {"role": "user", "content": f"(ticket {1000 + s}) {QUESTIONS[k]}"}]
            session.append(msgs)
            msgs = [*msgs, {"role": "assistant", "content": REPLIES[(k + s) % len(REPLIES)]}]
        out.append(session)
    return out


async def _chat(session, base: str, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices") or ():
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
    e2e = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("no usage in the stream")
    return {
        "ttft_s": ttft if ttft is not None else e2e,
        "e2e_s": e2e,
        "text": "".join(text),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
    }


async def drive(
    base: str, sessions, concurrency: int, max_tokens: int, request_timeout_s: float = 120.0
) -> tuple[dict, float, list[str]]:
    """Closed loop: `concurrency` clients, each running whole sessions in turn order. Returns the results by
    (session, turn), the wall time and the errors."""
    import aiohttp

    results: dict[tuple[int, int], dict] = {}
    errors: list[str] = []
    queue = iter(range(len(sessions)))
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)  # a stuck request is an error, not a stalled run
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:

        async def client():
            for s in queue:
                for t, messages in enumerate(sessions[s]):
                    try:
                        results[(s, t)] = await _chat(http, base, messages, max_tokens)
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        errors.append(f"session {s} turn {t}: {type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - t0, errors


async def front_overhead(base: str, direct: str, n: int = 20) -> dict:
    """Median TTFT of `n` sequential one-token requests with one short prompt (a prefix hit after the first),
    straight to a worker and through the front: what the front itself adds per request, without queueing."""
    import aiohttp

    msgs = [{"role": "user", "content": "a short prompt to time the front itself"}]
    out = {}
    async with aiohttp.ClientSession() as http:
        for name, url in (("direct_ms", direct), ("through_ms", base)):
            await _chat(http, url, msgs, 1)  # warm: connection and cache
            t = [(await _chat(http, url, msgs, 1))["ttft_s"] * 1e3 for _ in range(n)]
            out[name] = round(float(np.median(t)), 2)
    return out


# ---------------------------------------------------------------------------------------------- processes
def start_workers(n: int, args) -> list:
    wargs = [
        "--http-port",
        "0",
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
        "--swa-cache-tokens",
        str(args.swa_cache_tokens),
        "--torch-threads",
        str(max(1, (os.cpu_count() or 1) // n)),
    ]
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda _: start_server(wargs, "llm", timeout=300), range(n)))


def _delta(after: list[dict], before: list[dict] | None) -> list[dict]:
    if before is None:
        return after
    return [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]


def worker_stats(workers) -> list[dict]:
    out = []
    for w in workers:
        m = scrape(int(w.http_address.rsplit(":", 1)[1]))
        out.append(
            {
                "requests": sum(v for k, v in m.items() if k.startswith("llm_requests_finished_total")),
                "busy_s": m.get("llm_e2e_request_latency_seconds_sum", 0.0),
                "prompt_tokens": m.get("llm_prompt_tokens_total", 0.0),
                "cached_tokens": m.get("llm_cached_tokens_total", 0.0),
            }
        )
    return out


def _imbalance(values) -> float:
    a = np.asarray(values, dtype=float)
    return round(float(a.max() / a.mean()), 3) if a.size and a.mean() > 0 else 0.0


def summarize(results: dict, wall: float, errors: list[str], stats: list[dict]) -> dict:
    rs = list(results.values())
    ttft = np.array([r["ttft_s"] for r in rs]) * 1e3 if rs else np.zeros(1)
    prompt = sum(r["prompt_tokens"] for r in rs)
    cached = sum(r["cached_tokens"] for r in rs)
    return {
        "requests": len(rs),
        "errors": len(errors),
        "first_errors": errors[:3],
        "cached_fraction": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_ms": percentile(ttft, 50, 2),
        "ttft_p90_ms": percentile(ttft, 90, 2),
        "qps": round(len(rs) / wall, 3) if wall else 0.0,
        "seconds": round(wall, 2),
        "requests_per_worker": [int(s["requests"]) for s in stats],
        "busy_s_per_worker": [round(s["busy_s"], 2) for s in stats],
        "imbalance_requests_max_over_mean": _imbalance([s["requests"] for s in stats]),
        "imbalance_busy_max_over_mean": _imbalance([s["busy_s"] for s in stats]),
    }


def run_policy(policy: str, sessions, args, shared=None) -> tuple[dict, dict]:
    """One run through `mimo-epd router --http-port` with `policy`; on fresh workers unless `shared` are given."""
    workers = shared or start_workers(args.workers, args)
    before = worker_stats(workers) if shared else None
    router = None
    try:
        mport = free_port()
        spec = ",".join(f"{w.address}/{w.http_address}" for w in workers)
        router = start_server(
            [
                "--workers",
                spec,
                "--llm-policy",
                policy,
                "--http-port",
                "0",
                "--metrics-port",
                str(mport),
                "--log-level",
                "warning",
            ],
            "router",
            timeout=120,
        )
        results, wall, errors = asyncio.run(
            drive(f"http://{router.http_address}", sessions, args.concurrency, args.max_tokens, args.request_timeout_s)
        )
        out = summarize(results, wall, errors, _delta(worker_stats(workers), before))
        m = scrape(mport)  # before the overhead probe below: the prediction figures are the workload's
        n = m.get("router_prediction_error_tokens_count", 0.0)
        exact = m.get('router_prediction_error_tokens_bucket{le="0.0"}', 0) - m.get(
            'router_prediction_error_tokens_bucket{le="-1.0"}', 0
        )
        within = m.get('router_prediction_error_tokens_bucket{le="16.0"}', 0) - m.get(
            'router_prediction_error_tokens_bucket{le="-16.0"}', 0
        )
        over = m.get("router_prediction_over_tokens_total", 0.0)
        under = m.get("router_prediction_under_tokens_total", 0.0)
        out["prediction"] = {
            "requests": int(n),  # error = reported cached tokens - predicted
            "mean_abs_error_tokens": round((over + under) / n, 2) if n else None,
            "mean_error_tokens": round((over - under) / n, 2) if n else None,
            "exact_fraction": round(exact / n, 3) if n else None,
            "within_one_block_fraction": round(within / n, 3) if n else None,
        }
        out["front_overhead"] = asyncio.run(
            front_overhead(f"http://{router.http_address}", f"http://{workers[0].http_address}")
        )
        return out, results
    finally:
        if router is not None:
            router.stop()
        for w in workers if not shared else ():
            w.stop()


def run_gateway(sessions, args, shared=None) -> tuple[dict, dict]:
    try:
        from importlib.metadata import version

        import sglang_router  # noqa: F401

        gw_version = version("sglang-router")
    except ImportError:
        return {
            "error": f"sglang-router is not installed (pip install 'sglang-router=={GATEWAY_VERSION}', "
            "in the dev extra)"
        }, {}
    workers = shared or start_workers(args.workers, args)
    before = worker_stats(workers) if shared else None
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *(f"http://{w.http_address}" for w in workers),
        "--policy",
        args.gateway_policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warn",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    import threading

    threading.Thread(target=lambda: [log.append(x) for x in proc.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while True:  # ready: it answers /v1/models (forwarded to a worker; no generation, so no cache effect)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    return {
                        "error": f"the gateway did not start ({type(e).__name__}: {e}); its output: "
                        f"{''.join(log)[-800:]}",
                        "version": gw_version,
                    }, {}
                time.sleep(0.3)
        results, wall, errors = asyncio.run(
            drive(f"http://127.0.0.1:{port}", sessions, args.concurrency, args.max_tokens, args.request_timeout_s)
        )
        out = summarize(results, wall, errors, _delta(worker_stats(workers), before))
        out["front_overhead"] = asyncio.run(
            front_overhead(f"http://127.0.0.1:{port}", f"http://{workers[0].http_address}")
        )
        out.update(
            version=gw_version,
            policy=args.gateway_policy,
            note="the gateway found no tokenizer for model 'tiny' (it tries HuggingFace, unreachable here); "
            "cache_aware routes on the request text, which needs none",
        )
        return out, results
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for w in workers if not shared else ():
            w.stop()


def _mismatches(a: dict, b: dict) -> int:
    return sum(1 for k in a.keys() & b.keys() if a[k]["text"] != b[k]["text"]) + len(a.keys() ^ b.keys())


def _mismatch_detail(a: dict, b: dict, limit: int = 3) -> list[dict]:
    """The first requests whose texts differ: which, and the cached tokens each run had for it (a prefix hit in
    one run and a recompute in the other is where float rounding can differ)."""
    out = []
    for k in sorted(a.keys() & b.keys()):
        if a[k]["text"] != b[k]["text"] and len(out) < limit:
            n = next(
                (i for i, (x, y) in enumerate(zip(a[k]["text"], b[k]["text"])) if x != y),
                min(len(a[k]["text"]), len(b[k]["text"])),
            )
            out.append(
                {
                    "session": k[0],
                    "turn": k[1],
                    "prompt_tokens": a[k]["prompt_tokens"],
                    "cached_affinity": a[k]["cached_tokens"],
                    "cached_here": b[k]["cached_tokens"],
                    "first_differing_char": n,
                }
            )
    return out


def _ratio(x, y):
    return round(x / y, 3) if x is not None and y else None


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    p.add_argument("--sessions", type=int, default=24, help="chat sessions (default: 24)")
    p.add_argument("--turns", type=int, default=4, help="turns per session (default: 4)")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients (default: 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request (default: 16)")
    p.add_argument("--workers", type=int, default=2, help="LLM workers (default: 2)")
    p.add_argument(
        "--policies", default=",".join(POLICIES), help=f"our policies to run (default: {','.join(POLICIES)})"
    )
    p.add_argument(
        "--gateway",
        action=__import__("argparse").BooleanOptionalAction,
        default=True,
        help="also run SGLang's gateway (sglang-router) in front of the same workers (default: on)",
    )
    p.add_argument("--gateway-policy", default="cache_aware", help="the gateway's policy (default: cache_aware)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="each worker's full KV pool (default: 16384)")
    p.add_argument("--swa-cache-tokens", type=int, default=4096, help="each worker's SWA pool (default: 4096)")
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=120.0,
        help="a request still unanswered after this long counts as an error (default: 120)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 4 sessions x 3 turns, 2 clients, 2 tokens, affinity and round_robin (and the "
        "gateway) on one pair of workers, each run's prompts tagged apart; no output comparison",
    )


def main(args) -> dict:
    if args.quick:
        args.sessions, args.turns, args.concurrency, args.max_tokens = 4, 3, 2, 2
        args.policies = "affinity,round_robin"
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"--policies: unknown {', '.join(unknown)} (choose from {', '.join(POLICIES)})")
    if "affinity" not in policies:
        policies.insert(0, "affinity")  # the reference every ratio and output check is against
    out: dict = {
        "benchmark": "routing-live",
        "quick": bool(args.quick),
        "workers": args.workers,
        "sessions": args.sessions,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "requests": args.sessions * args.turns,
        "cpu_count": os.cpu_count(),
        "policies": {},
    }
    # --quick: one pair of workers for every run (starting workers dominates a short run), each run's prompts
    # tagged apart so that no run reuses another's cache; the texts then differ by design and are not compared.
    shared = start_workers(args.workers, args) if args.quick else None
    texts: dict[str, dict] = {}
    gw = None
    try:
        for i, p in enumerate(policies):
            sessions = workload(args.sessions, args.turns, tag=f"run {i}" if shared else "")
            out["policies"][p], texts[p] = run_policy(p, sessions, args, shared)
        if args.gateway:
            sessions = workload(args.sessions, args.turns, tag="gateway" if shared else "")
            gw, gw_texts = run_gateway(sessions, args, shared)
            if "error" not in gw:
                gw["outputs_mismatched_vs_affinity"] = None if shared else _mismatches(texts["affinity"], gw_texts)
            out["sglang_gateway"] = gw
    finally:
        for w in shared or ():
            w.stop()
    out["outputs_mismatched_vs_affinity"] = {
        p: None if shared else _mismatches(texts["affinity"], texts[p]) for p in policies if p != "affinity"
    }
    if not shared:
        out["output_mismatch_detail"] = {
            p: d for p in policies if p != "affinity" if (d := _mismatch_detail(texts["affinity"], texts[p]))
        }
    a = out["policies"]["affinity"]
    rr = out["policies"].get("round_robin")
    ok_gw = gw is not None and "error" not in gw
    out["ratios"] = {
        "affinity_cached_vs_round_robin": _ratio(a["cached_fraction"], rr["cached_fraction"]) if rr else None,
        "affinity_cached_vs_sglang_gateway": _ratio(a["cached_fraction"], gw["cached_fraction"]) if ok_gw else None,
        "affinity_ttft_p90_vs_sglang_gateway": _ratio(a["ttft_p90_ms"], gw["ttft_p90_ms"]) if ok_gw else None,
    }
    return out
