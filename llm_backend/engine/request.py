"""What a request is: its sampling parameters, its state while it runs, and what it returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from mimo_epd.common.prompt_rules import MAX_TOP_LOGPROBS

from ..kv import RequestKV
from .interfaces import Constraint, OutputGrammar, RequestStats

# Below this temperature sampling is greedy (the distribution is a point mass anyway, and dividing logits by
# 1e-300 overflows to inf / NaN).
GREEDY_EPS = 1e-5


class PromptTooLong(ValueError):
    """The prompt can never fit in the KV pools, whatever else is running."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


# error_code of a request whose media rows the prefix cache no longer held (media_span)
MEDIA_NEEDED = "media_needed"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep generating past the model's EOS token
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # and of the k most likely tokens at each position
    prompt_logprobs: bool = False
    grammar: OutputGrammar | None = None  # a compiled output constraint: each request gets its own matcher
    # sampling controls (engine/penalties.py, vLLM's meaning)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0  # the stop tokens are masked until this many tokens were generated

    def validate(
        self, max_tokens_limit: int = 1 << 31, max_temperature: float = 100.0, max_logit_bias: int = 300
    ) -> None:
        """Raises ValueError naming the field; every number is checked (a NaN temperature once killed the engine)."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens > max_tokens_limit:
            raise ValueError(
                f"max_tokens {self.max_tokens} is over the limit of {max_tokens_limit} (--max-tokens-limit)"
            )
        t = _finite("temperature", self.temperature)
        if not 0 <= t <= max_temperature:
            raise ValueError(f"temperature must be in [0, {max_temperature:g}], got {t:g}")
        p = _finite("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p:g}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 64):
            raise ValueError(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _finite(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < _finite("repetition_penalty", self.repetition_penalty) <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if len(self.logit_bias) > max_logit_bias:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {max_logit_bias} (--max-logit-bias)"
            )
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias: token ids must be non-negative integers, got {t!r}")
            if not -100.0 <= _finite("logit_bias", b) <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {t} must be in [-100, 100], got {b!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} is over max_tokens {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    usage: Usage
    finish_reason: str


@dataclass(eq=False)
class Request:
    """One request while it waits or runs. `finish_reason` is "" until it ends, then "stop", "length", "abort"
    or "error" (`error` says why, `error_code` is "resource_exhausted", "invalid" or "internal")."""

    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    kv: RequestKV | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # with top_logprobs k > 0
    cached_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    error_code: str = ""
    generator: torch.Generator | None = None
    media: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt position -> embedding row
    # Placeholder positions before this have no row in `media`: the prefix cache must hold them (the worker saw
    # the media's KV cached and skipped the encoder). Admission checks it; 0 = every row is in `media`.
    media_span: int = 0
    on_token: Callable | None = None  # (request, token_id, logprob | None), called from the engine thread
    on_finish: Callable | None = None  # (request)
    aborted: str = ""  # set by abort(): the reason it will finish with ("abort", or "stop" for stop strings)
    first_token_at: float = 0.0
    admitted_at: float = 0.0
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids plus EOS unless ignore_eos
    constraint: Constraint | None = None  # the output constraint's matcher (params.grammar.matcher())
    stats: RequestStats = field(default_factory=RequestStats)  # filled by the engine's features for the server

    # prompt + output, appended in place with every token (`append_token`): reading it is free at any length
    tokens: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    def append_token(self, token: int) -> None:
        """The one way a token joins the request: `output` and `tokens` grow together, O(1)."""
        self.output.append(token)
        self.tokens.append(token)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)
