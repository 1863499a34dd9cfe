"""The OpenAI (and SGLang-native) wire format: request parsing with type checks that name the field,
and the response / stream-chunk / error shapes.

Parsing never raises anything but `ServeError` (400, `param` = the offending field). Accepted, as in the
OpenAI API: chat `messages` with roles system / developer (as system) / user / assistant and content as a
string or a list of `text`, `image_url` (http(s) or `data:` URL; a bare string URL too), `video_url`,
`audio_url` and `input_audio` (base64 bytes and a format) parts; `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop` (a string or a
list; integers in the list are stop token ids), `logprobs` / `top_logprobs`, `n` (streamed too), `stream` with
`stream_options.include_usage`; the common extensions `top_k`, `ignore_eos`, `stop_token_ids`; the agentic
fields (`tools`, `tool_choice`, `parallel_tool_calls`, `chat_template_kwargs`, assistant `tool_calls` and
`reasoning_content`, `tool` messages), parsed by llm_backend/agentic. Features this server does not implement
(suffix, the deprecated functions) get a 400 that says so rather than being silently ignored. `n` and `best_of`
answer several samples per prompt. Sampling controls with vLLM's meaning:
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`, `min_tokens`. Completions take
a list of prompts (one choice each), `echo` with the prompt's logprobs (the first null), `max_tokens: 0` with echo,
and vLLM's `prompt_logprobs`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from llm_backend.agentic.request import AgenticOptions, parse_agentic
from llm_backend.agentic.tools import ToolError, template_message
from mimo_epd.common.http_edge import ERROR_TYPES, error_body  # noqa: F401 (the API's error shape)
from mimo_epd.common.prompt_rules import (
    MAX_TOP_LOGPROBS,
    RuleError,
    audio_in_video,
    is_token_ids,
    media_url,
    normalize_messages,
    type_name,
)
from mimo_epd.v1 import encoder_pb2

from .core import AUDIO_TRACK, Final, ServeError


@dataclass
class GenRequest:
    kind: str  # "chat" | "completion" | "generate"
    model: str = ""
    stream: bool = False
    include_usage: bool = False
    messages: list[dict] = field(default_factory=list)  # chat: what the template sees
    text: str | None = None
    token_ids: list[int] | None = None
    media: list[encoder_pb2.MediaItem] = field(default_factory=list)
    media_names: list[str] = field(default_factory=list)  # the field of each media item (errors name it)
    max_tokens: int | None = None
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k, seed, logprobs
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    agentic: AgenticOptions = field(default_factory=AgenticOptions)  # tools, reasoning, constraints
    # completions: every prompt of a list (text or token ids; `text` / `token_ids` hold the first), `echo` (the
    # prompt is returned before the completion, with its logprobs when logprobs are asked), `max_tokens: 0` with
    # echo (score the prompt, generate nothing), vLLM's `prompt_logprobs` (k: the prompt tokens' logprobs and, for
    # k > 0, each position's top k)
    prompts: list[tuple[str | None, list[int] | None]] = field(default_factory=list)
    echo: bool = False
    score_only: bool = False
    prompt_logprobs: int | None = None
    n: int = 1  # choices per prompt
    best_of: int = 1  # candidates per prompt, the n most likely returned


# ---------------------------------------------------------------------------------------- type checks
def _bad(param: str, msg: str) -> ServeError:
    return ServeError.invalid(f"'{param}': {msg}", param=param)


def _int(body: dict, key: str, lo: int | None = None, hi: int | None = None, param: str | None = None) -> int | None:
    v = body.get(key)
    param = param or key
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(param, f"expected an integer, got {type_name(v)}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise _bad(
            param, f"{v} is out of range [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        )
    return v


def _num(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"expected a number, got {type_name(v)}")
    v = float(v)
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        raise _bad(key, f"{v} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
    return v


def _bool(body: dict, key: str, param: str | None = None) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(param or key, f"expected a boolean, got {type_name(v)}")
    return v


def _controls(body: dict, s: dict) -> None:
    """The sampling controls (engine/penalties.py): penalties, logit_bias (token id -> bias; JSON keys are strings),
    min_tokens. Ranges are checked here by field; the vocabulary and --max-logit-bias by the engine."""
    for key in ("presence_penalty", "frequency_penalty"):
        if (v := _num(body, key, -2.0, 2.0)) is not None:
            s[key] = v
    if (v := _num(body, "repetition_penalty", 0.0, 10.0, lo_open=True)) is not None:
        s["repetition_penalty"] = v
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias", f"expected an object of token id -> bias, got {type_name(bias)}")
        pairs = []
        for k, b in bias.items():
            try:
                t = int(k)
            except (TypeError, ValueError):
                raise _bad("logit_bias", f"keys must be token ids, got {str(k)[:32]!r}") from None
            if t < 0:
                raise _bad("logit_bias", f"token ids must be >= 0, got {t}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise _bad("logit_bias", f"the bias of token {t} must be a number in [-100, 100]")
            pairs.append((t, float(b)))
        s["logit_bias"] = tuple(pairs)
    if (m := _int(body, "min_tokens", 0)) is not None:
        s["min_tokens"] = m


# vLLM's sampling extensions this server does not apply, with the value that means "off": a request asking for
# anything else is refused naming the field rather than answered as if it had not asked (docs/api.md).
NOT_APPLIED = {
    "min_p": 0,
    "use_beam_search": False,
    "length_penalty": 1,
    "truncate_prompt_tokens": None,
    "include_stop_str_in_output": False,
    "priority": 0,
}


def _unsupported(body: dict) -> None:
    if body.get("functions"):
        raise _bad("functions", "the deprecated 'functions' field is not supported: use 'tools'")
    for key, off in NOT_APPLIED.items():
        if key in body and body[key] != off:
            raise _bad(key, f"is not supported by this server (only {off!r}, which changes nothing)")


def _samples(body: dict, req: GenRequest, max_samples: int) -> None:
    """`n` choices per prompt and `best_of` candidates (the n with the highest cumulative logprob are returned)."""
    n = _int(body, "n", 1, max_samples)
    best = _int(body, "best_of", 1, max_samples)
    req.n = n or 1
    req.best_of = best or req.n
    if req.best_of < req.n:
        raise _bad("best_of", f"must be >= n ({req.n}), got {req.best_of}")
    if req.best_of > req.n and req.stream:  # the best n of best_of are known only at the end
        raise _bad("best_of", "best_of > n is answered without stream")


def _common(body: dict, req: GenRequest, min_tokens: int = 1, max_samples: int = 16) -> None:
    _unsupported(body)
    _controls(body, req.sampling)
    req.stream = bool(_bool(body, "stream"))
    _samples(body, req, max_samples)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"expected a string, got {type_name(model)}")
    req.model = model or ""
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", f"expected an object, got {type_name(so)}")
        req.include_usage = bool(_bool(so, "include_usage", "stream_options.include_usage"))
    mt = _int(body, "max_completion_tokens", 1)
    req.max_tokens = mt if mt is not None else _int(body, "max_tokens", min_tokens)
    s = req.sampling
    if (t := _num(body, "temperature", 0.0, 2.0)) is not None:
        s["temperature"] = t
    if (p := _num(body, "top_p", 0.0, 1.0, lo_open=True)) is not None:
        s["top_p"] = p
    if (k := _int(body, "top_k", -1)) is not None:
        s["top_k"] = max(k, 0)  # -1 = off (vLLM / SGLang), as 0 here
    if (seed := _int(body, "seed")) is not None:
        s["seed"] = seed
    req.ignore_eos = bool(_bool(body, "ignore_eos"))
    _stops(body.get("stop"), "stop", req)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise _bad("stop_token_ids", "expected an array of integers")
        req.stop_token_ids += ids


def _stops(stop, param: str, req: GenRequest) -> None:
    if stop is None:
        return
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise _bad(param, f"expected a string or an array, got {type_name(stop)}")
    for i, s in enumerate(items):
        if isinstance(s, str):
            if not s:
                raise _bad(f"{param}[{i}]", "a stop string must not be empty")
            req.stop.append(s)
        elif isinstance(s, int) and not isinstance(s, bool):
            req.stop_token_ids.append(s)
        else:
            raise _bad(f"{param}[{i}]", f"expected a string or a token id, got {type_name(s)}")


MODALITIES = {"image": encoder_pb2.IMAGE, "video": encoder_pb2.VIDEO, "audio": encoder_pb2.AUDIO}


def _media_url(url, param: str, kind: str = "image") -> encoder_pb2.MediaItem:
    try:
        url = media_url(url, param)
    except RuleError as e:
        raise _bad(e.param, e.message) from None
    return encoder_pb2.MediaItem(url=url, modality=MODALITIES[kind])


def _media_item(ref) -> encoder_pb2.MediaItem:
    if ref.data is not None:  # input_audio: the bytes themselves
        return encoder_pb2.MediaItem(data=ref.data, modality=MODALITIES[ref.kind])
    return _media_url(ref.url, ref.param, ref.kind)


# ---------------------------------------------------------------------------------------- requests
def parse_chat(body, max_samples: int = 16) -> GenRequest:
    if not isinstance(body, dict):
        raise ServeError.invalid(f"the request body must be a JSON object, got {type_name(body)}")
    req = GenRequest("chat")
    _common(body, req, max_samples=max_samples)
    try:
        req.agentic = parse_agentic(body, chat=True)
        req.messages, refs = normalize_messages(
            body.get("messages"), build=template_message, audio_in_video=audio_in_video(body)
        )
    except RuleError as e:
        raise _bad(e.param, e.message) from None
    except ToolError as e:
        raise _bad(e.param, e.detail) from None
    req.media += [_media_item(ref) for ref in refs]
    req.media_names += [ref.param + (AUDIO_TRACK if ref.track_of else "") for ref in refs]
    lp = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not lp:
        raise _bad("top_logprobs", "needs logprobs: true")
    if lp:
        req.sampling["logprobs"] = True
        req.top_logprobs = top or 0
    return req


def parse_completion(body, max_prompts: int = 64, max_samples: int = 16) -> GenRequest:
    if not isinstance(body, dict):
        raise ServeError.invalid(f"the request body must be a JSON object, got {type_name(body)}")
    req = GenRequest("completion")
    _common(body, req, min_tokens=0, max_samples=max_samples)  # max_tokens 0: echo only (below)
    try:
        req.agentic = parse_agentic(body, chat=False)
    except ToolError as e:
        raise _bad(e.param, e.detail) from None
    if body.get("suffix"):
        raise _bad("suffix", "is not supported by this server")
    req.echo = bool(_bool(body, "echo"))
    req.prompts = _prompts(body.get("prompt"), max_prompts)
    req.text, req.token_ids = req.prompts[0]
    if len(req.prompts) > 1 and req.stream:
        raise _bad("stream", "streaming answers one prompt; send a list of prompts without stream")
    lp = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if lp is not None:
        req.sampling["logprobs"] = True
        req.top_logprobs = lp
    req.prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    if req.prompt_logprobs is not None and lp is None:
        req.top_logprobs = req.prompt_logprobs  # vLLM's k: the prompt positions' top k
    if _int(body, "max_tokens", 0) == 0 and body.get("max_completion_tokens") is None:
        if not req.echo:
            raise _bad("max_tokens", "0 is allowed with echo only (score the prompt, generate nothing)")
        req.score_only, req.max_tokens = True, 1  # one token computed, none returned
    if req.echo and req.stream:
        raise _bad("echo", "echo is answered without stream")
    if req.prompt_logprobs is not None and req.stream:
        raise _bad("prompt_logprobs", "prompt logprobs are answered without stream")
    if req.max_tokens is None:
        req.max_tokens = 16  # the OpenAI completions default
    return req


def _prompts(prompt, limit: int) -> list[tuple[str | None, list[int] | None]]:
    """A completions `prompt`: a string, token ids, or a list of either (each one choice)."""
    if prompt is None:
        raise _bad("prompt", "is required")
    if isinstance(prompt, str):
        return [(prompt, None)]
    if is_token_ids(prompt):
        return [(None, list(prompt))]
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", "expected a string, token ids, or a non-empty array of either")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise _bad("prompt", "token ids must be integers in [0, 2^63)")
    if len(prompt) > limit:
        raise _bad("prompt", f"{len(prompt)} prompts in one request; at most {limit} (--max-prompts-per-request)")
    out: list[tuple[str | None, list[int] | None]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append((p, None))
        elif is_token_ids(p):
            out.append((None, list(p)))
        else:
            raise _bad(f"prompt[{i}]", "expected a string or a non-empty array of token ids in [0, 2^63)")
    return out


def parse_generate(body) -> GenRequest:
    """SGLang's native `POST /generate`: `text` or `input_ids`, `sampling_params`, `stream`, `image_data`."""
    if not isinstance(body, dict):
        raise ServeError.invalid(f"the request body must be a JSON object, got {type_name(body)}")
    req = GenRequest("generate")
    req.stream = bool(_bool(body, "stream"))
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if text is not None and ids is not None:
        raise ServeError.invalid("give either 'text' or 'input_ids', not both", param="text")
    if isinstance(text, str):
        req.text = text
    elif ids is not None:
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
            ids = ids[0]
        if not is_token_ids(ids):
            raise _bad("input_ids", "expected a non-empty array of token ids in [0, 2^63) (one prompt per request)")
        req.token_ids = ids
    elif text is None:
        raise _bad("text", "give 'text' or 'input_ids'")
    else:
        raise _bad("text", "expected a string (one prompt per request)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise _bad("sampling_params", f"expected an object, got {type_name(sp)}")
    _unsupported(sp)
    req.max_tokens = _int(sp, "max_new_tokens", 1, param="sampling_params.max_new_tokens") or 128
    s = req.sampling
    if (t := _num(sp, "temperature", 0.0, 100.0)) is not None:
        s["temperature"] = t
    if (p := _num(sp, "top_p", 0.0, 1.0, lo_open=True)) is not None:
        s["top_p"] = p
    if (k := _int(sp, "top_k", -1, param="sampling_params.top_k")) is not None:
        s["top_k"] = max(k, 0)
    seed = _int(sp, "sampling_seed", param="sampling_params.sampling_seed")
    if seed is None:
        seed = _int(sp, "seed", param="sampling_params.seed")
    if seed is not None:
        s["seed"] = seed
    req.ignore_eos = bool(_bool(sp, "ignore_eos", "sampling_params.ignore_eos"))
    _stops(sp.get("stop"), "sampling_params.stop", req)
    ids = sp.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise _bad("sampling_params.stop_token_ids", "expected an array of integers")
        req.stop_token_ids += ids
    if _bool(body, "return_logprob"):
        s["logprobs"] = True
    images = body.get("image_data")
    if images is not None and not isinstance(images, (str, list)):
        raise _bad("image_data", f"expected a URL string or an array of them, got {type_name(images)}")
    for j, url in enumerate([images] if isinstance(images, str) else images or []):
        req.media.append(_media_url(url, f"image_data[{j}]"))
    return req


# ---------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(final: Final) -> dict:
    out = {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": final.accepted_prediction_tokens,
            "rejected_prediction_tokens": final.rejected_prediction_tokens,
        },
    }
    if final.kv_events_position:  # an extension (docs/api.md): routers wait for their index to reach it
        out["kv_events_position"] = final.kv_events_position
    return out


def token_piece(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and raw bytes (a byte token that is part of a multi-byte character has no text of its own)."""
    if getattr(tokenizer, "tok", None) is None:  # the byte tokenizer
        raw = bytes([token_id]) if token_id < 256 else b""
        return raw.decode("utf-8", errors="replace"), list(raw)
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer, ids: list[int], lps: list[float], tops: list) -> dict:
    content = []
    for k, (t, lp) in enumerate(zip(ids, lps)):
        tok, raw = token_piece(tokenizer, t)
        entry = {"token": tok, "logprob": lp, "bytes": raw, "top_logprobs": []}
        for alt, alp in tops[k] if k < len(tops) else []:
            at, ab = token_piece(tokenizer, alt)
            entry["top_logprobs"].append({"token": at, "logprob": alp, "bytes": ab})
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokenizer, ids: list[int], lps: list[float], tops: list, offset0: int = 0) -> dict:
    tokens, offsets, top_out = [], [], []
    pos = offset0
    for k, t in enumerate(ids[: len(lps)]):
        tok, _ = token_piece(tokenizer, t)
        tokens.append(tok)
        offsets.append(pos)
        pos += len(tok)
        top_out.append({token_piece(tokenizer, a)[0]: alp for a, alp in tops[k]} if k < len(tops) else None)
    return {
        "tokens": tokens,
        "token_logprobs": list(lps[: len(tokens)]),
        "top_logprobs": top_out,
        "text_offset": offsets,
    }


def echo_logprobs(tokenizer, prompt: list[int], plps: list[float], ptops: list, ids: list[int], lps, tops) -> dict:
    """Completions logprobs with `echo`: the prompt's tokens first (the first one's logprob is null, as OpenAI's and
    vLLM's are), then the completion's. Top logprobs per position when asked (null for the first prompt token)."""
    tokens, offsets, lp_out, top_out = [], [], [], []
    pos = 0
    for k, t in enumerate(prompt + ids):
        piece, _ = token_piece(tokenizer, t)
        tokens.append(piece)
        offsets.append(pos)
        pos += len(piece)
        if k < len(prompt):
            lp_out.append(None if k == 0 else plps[k - 1])
            top = ptops[k - 1] if 0 < k <= len(ptops) else None
        else:
            g = k - len(prompt)
            lp_out.append(lps[g] if g < len(lps) else None)
            top = tops[g] if g < len(tops) else None
        top_out.append({token_piece(tokenizer, a)[0]: alp for a, alp in top} if top else None)
    return {"tokens": tokens, "token_logprobs": lp_out, "top_logprobs": top_out, "text_offset": offsets}


def prompt_logprobs_entries(tokenizer, prompt: list[int], plps: list[float], ptops: list) -> list:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    with the prompt's own token and each position's top k (rank 1 = most likely; the prompt token's rank only
    when it is among them)."""
    out: list = [None]
    for k in range(1, len(prompt)):
        entry = {}
        top = ptops[k - 1] if k - 1 < len(ptops) else []
        for rank, (t, lp) in enumerate(top, 1):
            entry[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": token_piece(tokenizer, t)[0]}
        t = prompt[k]
        if str(t) not in entry:
            entry[str(t)] = {"logprob": plps[k - 1], "rank": None, "decoded_token": token_piece(tokenizer, t)[0]}
        out.append(entry)
    return out


def completion_batch(rid: str, model: str, choices: list[dict], finals: list[list[Final]], scored_only: bool) -> dict:
    """One completions response for a list of prompts (`finals`: each prompt's samples): choices in OpenAI's order,
    usage summed with each prompt counted once (no completion tokens when the prompts were only scored)."""
    prompt = sum(f[0].prompt_tokens for f in finals)
    cached = sum(f[0].cached_tokens for f in finals)
    done = 0 if scored_only else sum(x.completion_tokens for f in finals for x in f)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def summed_usage(finals: list[Final], prompt_once: bool) -> dict:
    """Usage of several samples: completion tokens summed; the prompt counted once when the samples share it."""
    prompt = finals[0].prompt_tokens if prompt_once else sum(f.prompt_tokens for f in finals)
    done = sum(f.completion_tokens for f in finals)
    cached = finals[0].cached_tokens if prompt_once else sum(f.cached_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "total_tokens": prompt + done,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_response(rid: str, model: str, message: dict, finish_reason: str, final: Final, logprobs) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(final),
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict,
    finish_reason=None,
    logprobs=None,
    include_usage: bool = False,
    index: int = 0,
) -> dict:
    out = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        out["usage"] = None
    return out


def completion_response(rid: str, model: str, text: str, final: Final, logprobs: dict | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": final.finish_reason}],
        "usage": usage(final),
    }


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    text: str,
    finish_reason=None,
    logprobs=None,
    include_usage: bool = False,
    index: int = 0,
) -> dict:
    out = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, model: str, created: int, obj: str, final: Final) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(final)}


def generate_meta(rid: str, final: Final | None, completion_tokens: int, prompt_tokens: int) -> dict:
    meta = {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "finish_reason": None}
    if final is not None:
        fr = {"type": final.finish_reason}
        if final.finish_reason == "length":
            fr["length"] = final.completion_tokens
        elif final.matched_stop is not None:
            fr["matched"] = final.matched_stop
        meta.update(
            finish_reason=fr,
            cached_tokens=final.cached_tokens,
            e2e_latency=round(final.e2e_s, 6),
            ttft=round(final.ttft_s, 6),
            media_tokens=final.media_tokens,
        )
        if final.kv_events_position:
            meta["kv_events_position"] = final.kv_events_position
    return meta
