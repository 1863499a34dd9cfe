"""`mimo-epd bench structured`: grammar-constrained decoding (xgrammar) on the trained default model, the offline
engine, every mode side by side on the same requests.

Modes: `unconstrained` (the reference), `json_schema` (SCHEMA, the training mix's "topic" / "summary" object) and
`regex` (REGEX); batch 1 (requests one after another) and batch 16 (all arriving at once, 16 running), greedy,
at most `--max-tokens` tokens, stopping at EOS. Prompts ask for the JSON object the way the training samples do.

Reported per mode and batch: output tokens/s (output tokens over wall time), ITL P50/P90 (gaps between
consecutive tokens of a request), and the share of outputs that parse and validate against SCHEMA (`jsonschema`)
and that fully match REGEX: the unconstrained model's shares are the contrast. Compile time of each grammar cold
(a fresh compiler) and cached (the same constraint again, answered from the cache). `ratios` has
`tokens_per_s_json_schema_vs_unconstrained_b16`, `tokens_per_s_regex_vs_unconstrained_b16`, and the validity
shares `valid_json_schema`, `valid_unconstrained`.
"""

from __future__ import annotations

import json
import re
import sys
import time

from mimo_epd.common.stats import percentile

SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 40}, "summary": {"type": "string", "maxLength": 120}},
    "required": ["topic", "summary"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]+( [a-z]+){2,8}\."
TOPICS = [
    "lists",
    "dicts",
    "tuples",
    "sets",
    "generators",
    "decorators",
    "the with statement",
    "classes",
    "exceptions",
    "modules",
    "f-strings",
    "pathlib",
    "asyncio",
    "iterators",
    "lambda",
    "comprehensions",
]
MODES = ("unconstrained", "json_schema", "regex")


def log(msg: str) -> None:
    print(f"[bench structured] {msg}", file=sys.stderr, flush=True)


def prompts(model: str, n: int) -> list[list[int]]:
    from llm_backend.server.chat_template import load_chat_template
    from llm_backend.tokenizer import load_tokenizer

    tok, template = load_tokenizer(model), load_chat_template(model)
    out = []
    for i in range(n):
        q = f'What are {TOPICS[i % len(TOPICS)]}? Reply with a JSON object with the keys "topic" and "summary".'
        out.append(tok.encode(template.render([{"role": "user", "content": q}]), add_bos=False))
    return out


def valid_json(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run(llm, grammar, reqs: list[list[int]], batch: int, max_tokens: int) -> dict:
    from llm_backend import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, grammar=grammar)
    llm.generate(prompt_token_ids=[reqs[0]], sampling_params=SamplingParams(max_tokens=4, grammar=grammar))
    stamps: dict[int, list[float]] = {}

    def on_token(r, _tok, _lp):
        stamps.setdefault(r.id, []).append(time.perf_counter())

    start, done, pending = time.perf_counter(), [], list(reqs)
    while pending or llm.has_work():
        while pending and len(llm.scheduler.running) + len(llm.scheduler.waiting) < batch:
            done.append(llm.add_request(pending.pop(0), sp, on_token=on_token))
        llm.step()
    wall = time.perf_counter() - start
    itl = [b - a for r in done for a, b in zip(stamps.get(r.id, []), stamps.get(r.id, [])[1:])]
    texts = [llm.tokenizer.decode([t for t in r.output if t not in r.stop_ids]) for r in done]
    n_out = sum(len(r.output) for r in done)
    return {
        "requests": len(done),
        "output_tokens": n_out,
        "seconds": round(wall, 3),
        "tokens_per_s": round(n_out / wall, 2),
        "itl_ms": {"p50": round(percentile(itl, 50) * 1e3, 2), "p90": round(percentile(itl, 90) * 1e3, 2)},
        "finish_stop": round(sum(r.finish_reason == "stop" for r in done) / len(done), 4),
        "valid_json_schema": round(sum(map(valid_json, texts)) / len(texts), 4),
        "matches_regex": round(sum(bool(re.fullmatch(REGEX, t)) for t in texts) / len(texts), 4),
        "example": texts[0][:160],
    }


def compile_times(llm) -> dict:
    from llm_backend.agentic.grammar import ConstraintSpec, GrammarCompilerPool, tokenizer_info

    info = tokenizer_info(llm.tokenizer, llm.model.config.vocab_size, llm._eos)
    out = {}
    for kind, value in (("json_schema", SCHEMA), ("regex", REGEX)):
        pool = GrammarCompilerPool(info)
        spec = ConstraintSpec(kind, value, kind)
        t0 = time.perf_counter()
        pool.compile_sync(spec)
        t1 = time.perf_counter()
        pool.compile_sync(ConstraintSpec(kind, json.loads(json.dumps(value)), kind))
        t2 = time.perf_counter()
        out[kind] = {"cold_ms": round((t1 - t0) * 1e3, 3), "cached_ms": round((t2 - t1) * 1e3, 4)}
        pool.close()
    return out


def main(args) -> dict:
    import torch

    from llm_backend import LLM
    from llm_backend.agentic.grammar import ConstraintSpec, GrammarCompilerPool, tokenizer_info

    torch.set_num_threads(args.threads)
    n1, n16, mt = (2, 16, 16) if args.quick else (args.requests_b1, args.requests_batch, args.max_tokens)
    llm = LLM(args.model, max_running=16, kv_cache_tokens=32768, swa_cache_tokens=8192)
    pool = GrammarCompilerPool(tokenizer_info(llm.tokenizer, llm.model.config.vocab_size, llm._eos))
    grammars = {
        "unconstrained": None,
        "json_schema": pool.compile_sync(ConstraintSpec("json_schema", SCHEMA, "response_format")),
        "regex": pool.compile_sync(ConstraintSpec("regex", REGEX, "guided_regex")),
    }
    results: dict = {}
    for batch, n in ((1, n1), (16, n16)):
        reqs = prompts(args.model, n)
        for mode in MODES:
            log(f"{mode} batch {batch}: {n} requests")
            results[f"{mode}_b{batch}"] = run(llm, grammars[mode], reqs, batch, mt)

    def ratio(a: str, b: str) -> float:
        return round(results[a]["tokens_per_s"] / results[b]["tokens_per_s"], 4) if results[b]["tokens_per_s"] else 0.0

    return {
        "bench": "structured",
        "model": args.model,
        "quick": bool(args.quick),
        "max_tokens": mt,
        "threads": args.threads,
        "modes": results,
        "compile": compile_times(llm),
        "ratios": {
            "tokens_per_s_json_schema_vs_unconstrained_b16": ratio("json_schema_b16", "unconstrained_b16"),
            "tokens_per_s_regex_vs_unconstrained_b16": ratio("regex_b16", "unconstrained_b16"),
            "tokens_per_s_json_schema_vs_unconstrained_b1": ratio("json_schema_b1", "unconstrained_b1"),
            "valid_json_schema": results["json_schema_b16"]["valid_json_schema"],
            "valid_unconstrained": results["unconstrained_b16"]["valid_json_schema"],
            "regex_match": results["regex_b16"]["matches_regex"],
            "regex_match_unconstrained": results["unconstrained_b16"]["matches_regex"],
        },
    }


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="the model (default: tiny, the shipped trained one)")
    p.add_argument("--requests-b1", type=int, default=8, help="requests of the batch-1 runs (default: 8)")
    p.add_argument("--requests-batch", type=int, default=32, help="requests of the batch-16 runs (default: 32)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request at most (default: 96)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
