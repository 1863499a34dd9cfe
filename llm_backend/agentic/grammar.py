"""Grammar-constrained decoding with xgrammar: what a request's output must match, compiled off the event loop and
cached, and the per-request matcher that masks the logits and follows the accepted tokens.

Constraints (`ConstraintSpec`): `response_format` `json_object` / `json_schema`, the vLLM-style extras (a regex, an
EBNF grammar, a choice list) and strict tool calling (`tool_choice` `required` or a named function, or `auto` with
a tool marked `strict`: MiMo's XML tool-call format with each call's parameters held to the tool's schema, xgrammar's
built-in structural tag for that format). Every constraint is one xgrammar structural tag; with thinking on it is
preceded by the reasoning block the template opened (any text, then `</think>\\n\\n`), so reasoning stays free.

Compilation (`GrammarCompilerPool.compile`): keyed by a SHA-256 of the constraint's canonical JSON; an LRU cache of
`--grammar-cache-size` compiled grammars, identical compiles in flight are shared; each runs on a worker thread
(never on the event loop) under `--grammar-compile-timeout-s`. A constraint xgrammar rejects or one that does not
compile in time is a `GrammarError` naming the request field (a 400); a timed-out compile keeps running on its
thread and lands in the cache, so a retry is answered from there.

Decoding (`GrammarConstraint`, one per request): before sampling, `apply_masks` fills one token bitmask row per
constrained request of the step and applies it to their logits at once (xgrammar's CPU kernel, or its CUDA kernel
for logits on the GPU); the scheduler calls `accept(token)` for every token it appends. Speculative decoding
verifies draft positions one after the other: row i is masked at the state after drafts 1..i-1, which the verifier
accepts tentatively and rolls back afterwards (`rollback`), so a draft the grammar
forbids has probability 0 under the target and is rejected; the output is exactly that of constrained decoding
without speculation. A grammar that is complete allows only the model's stop tokens; one that cannot finish inside
max_tokens ends with finish_reason "length".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xgrammar as xgr
from xgrammar import structural_tag as st

# Whitespace a JSON value may have between two tokens: xgrammar allows any amount by default, and a small model
# then pads with newlines until max_tokens.
MAX_JSON_WHITESPACE = 1
KINDS = ("json_object", "json_schema", "regex", "ebnf", "choice", "tools")


class GrammarError(ValueError):
    """A constraint that cannot be used (rejected by xgrammar, or too slow to compile); `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"'{param}': {message}")
        self.param, self.detail = param, message


@dataclass(frozen=True)
class ConstraintSpec:
    kind: str  # one of KINDS
    value: Any  # the schema, pattern, grammar text, choices, or {"tools": [...], "tool_choice": ...}
    param: str  # the request field it came from
    thinking: bool = False  # the output starts inside the template's <think> block

    @property
    def key(self) -> str:
        canon = json.dumps([self.kind, self.value, self.thinking], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canon.encode()).hexdigest()


def _body(spec: ConstraintSpec):
    v = spec.value
    if spec.kind == "json_object":
        return st.JSONSchemaFormat(json_schema={"type": "object"}, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if spec.kind == "json_schema":
        return st.JSONSchemaFormat(json_schema=v, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if spec.kind == "regex":
        return st.RegexFormat(pattern=v)
    if spec.kind == "ebnf":
        return st.GrammarFormat(grammar=v)
    if spec.kind == "choice":
        return st.OrFormat(elements=[st.ConstStringFormat(value=c) for c in v])
    raise ValueError(f"unknown constraint kind {spec.kind!r}")


def structural_tag(spec: ConstraintSpec) -> xgr.StructuralTag:
    """The xgrammar structural tag of a constraint (reasoning block first when thinking)."""
    if spec.kind == "tools":
        return xgr.get_builtin_structural_tag(
            "qwen_3_5",
            tools=spec.value["tools"],
            tool_choice=spec.value["tool_choice"],
            reasoning="enabled" if spec.thinking else "disabled",
            parallel_tool_calls=spec.value.get("parallel", True),
            max_whitespace_cnt=MAX_JSON_WHITESPACE,
        )
    body = _body(spec)
    if not spec.thinking:
        return xgr.StructuralTag(format=body)
    think = st.TagFormat(begin="", content=st.AnyTextFormat(excludes=["<think>", "</think>"]), end="</think>")
    return xgr.StructuralTag(format=st.SequenceFormat(elements=[think, st.ConstStringFormat(value="\n\n"), body]))


# ---------------------------------------------------------------------------------------- tokenizer info
def tokenizer_info(tokenizer, vocab_size: int, stop_ids) -> xgr.TokenizerInfo:
    """xgrammar's view of the engine's tokenizer: a checkpoint's `tokenizers` vocabulary (byte-level BPE, byte
    fallback or raw pieces, read from its decoder), or the byte tokenizer's 256 bytes (its BOS / EOS are special)."""
    inner = getattr(tokenizer, "tok", None)
    stops = sorted(int(t) for t in stop_ids)
    if inner is None:
        vocab: list[Any] = [bytes([i]) for i in range(256)] + [""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    decoder = json.dumps(json.loads(inner.to_str()).get("decoder"))
    if '"ByteLevel"' in decoder:
        vtype = xgr.VocabType.BYTE_LEVEL
    elif '"ByteFallback"' in decoder:
        vtype = xgr.VocabType.BYTE_FALLBACK
    else:
        vtype = xgr.VocabType.RAW
    n = inner.get_vocab_size()
    pieces = [inner.id_to_token(i) or "" for i in range(n)] + [""] * max(0, vocab_size - n)
    return xgr.TokenizerInfo(pieces, vtype, vocab_size=vocab_size, stop_token_ids=stops)


# ---------------------------------------------------------------------------------------- compilation
@dataclass
class CompileStats:
    compiled: int = 0
    cache_hits: int = 0
    failures: int = 0
    timeouts: int = 0
    compile_s: list[float] = field(default_factory=list)  # the last cold compiles' seconds (bounded)


class Grammar:
    """A compiled constraint, shared by every request that uses it; `matcher()` gives a request its own state."""

    def __init__(self, compiled: xgr.CompiledGrammar, spec: ConstraintSpec):
        self.compiled, self.spec = compiled, spec

    def matcher(self) -> GrammarConstraint:
        return GrammarConstraint(self.compiled)


class GrammarCompilerPool:
    def __init__(self, info: xgr.TokenizerInfo, timeout_s: float = 10.0, cache_size: int = 256, threads: int = 2):
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.timeout_s, self.cache_size = timeout_s, cache_size
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.cache: OrderedDict[str, Grammar] = OrderedDict()
        self.inflight: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.stats = CompileStats()

    def _compile(self, spec: ConstraintSpec) -> Grammar:
        t0 = time.perf_counter()
        try:
            g = Grammar(self.compiler.compile_structural_tag(structural_tag(spec)), spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, its own errors
            with self.lock:
                self.stats.failures += 1
                self.inflight.pop(spec.key, None)
            raise GrammarError(spec.param, f"cannot be compiled into a grammar: {_reason(e)}") from None
        with self.lock:
            self.stats.compiled += 1
            self.stats.compile_s = (self.stats.compile_s + [time.perf_counter() - t0])[-64:]
            self.cache[spec.key] = g
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            self.inflight.pop(spec.key, None)
        return g

    def cached(self, spec: ConstraintSpec) -> Grammar | None:
        with self.lock:
            g = self.cache.get(spec.key)
            if g is not None:
                self.cache.move_to_end(spec.key)
                self.stats.cache_hits += 1
            return g

    def compile_sync(self, spec: ConstraintSpec) -> Grammar:
        """Compiles on the calling thread (offline use, benchmarks); cached like `compile`."""
        return self.cached(spec) or self._compile(spec)

    async def compile(self, spec: ConstraintSpec) -> Grammar:
        g = self.cached(spec)
        if g is not None:
            return g
        with self.lock:
            fut = self.inflight.get(spec.key)
            if fut is None:
                fut = self.pool.submit(self._compile, spec)
                self.inflight[spec.key] = fut
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except TimeoutError:
            self.stats.timeouts += 1
            raise GrammarError(
                spec.param,
                f"the grammar did not compile within {self.timeout_s:g} s (--grammar-compile-timeout-s); "
                "simplify the schema or retry",
            ) from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def pool_for_engine(engine) -> GrammarCompilerPool:
    """The compiler pool of a serving engine: its tokenizer and stop tokens, its config's time limit and cache."""
    cfg = engine.config
    info = tokenizer_info(engine.tokenizer, engine.model.config.vocab_size, engine._eos)
    return GrammarCompilerPool(info, cfg.grammar_compile_timeout_s, cfg.grammar_cache_size)


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix (time and source line)."""
    lines = str(e).strip().splitlines()
    first = re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(e).__name__
    return first[:300]


# ---------------------------------------------------------------------------------------- decoding
class XGrammarMasker:
    """The engine's `ConstraintMasker` for xgrammar matchers: one bitmask for a step's constrained rows."""

    def apply(self, constraints, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        return apply_masks(constraints, rows)


MASKER = XGrammarMasker()


class GrammarConstraint:
    """One request's matcher (the engine's `Constraint`, llm_backend/engine/interfaces.py). Called from the engine
    thread only."""

    masker = MASKER

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.2
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def accept(self, token: int) -> bool:
        """Advances with an appended token; False when the grammar forbids it (nothing changes then)."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():  # a verified run past an accepted stop token: the scheduler cuts it there
            bitmask[row] = -1
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_masks(constraints: list[GrammarConstraint], rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Masks each logits row (1-D, float) with its request's grammar, one bitmask for the batch; returns the rows
    (new float32 tensors; tokens past the grammar's vocabulary get -inf too)."""
    if not constraints:
        return rows
    vocab = constraints[0].vocab_size
    bitmask = xgr.allocate_token_bitmask(len(constraints), vocab)
    for i, c in enumerate(constraints):
        c.fill(bitmask, i)
    logits = torch.stack([r.float() for r in rows])
    width = logits.shape[-1]
    if width > vocab:
        logits[:, vocab:] = float("-inf")
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=min(width, vocab))
    return list(logits.unbind(0))
