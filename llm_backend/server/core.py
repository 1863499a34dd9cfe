"""The one generation path behind gRPC Generate and the HTTP API: prepare a prompt (text or ids, media
through the encoder), admit it to the engine, and turn the engine's token callbacks into text chunks.

- Media items go to the encoder (`--encoder`, an encoder or the router); each item's embedding rows take
  the prompt positions right after BOS, in order, with placeholder ids derived from the item's content
  key (ids >= the vocabulary size): the same image is a prefix-cache hit, different images never are.
- Text comes out of `IncrementalDetokenizer` (UTF-8 and word boundaries right) and through `StopMatcher`
  (stop strings across token boundaries, excluded from the text); on a match the request is finished
  with `engine.abort(r, reason="stop")` so its KV is kept in the prefix cache. Stop tokens (the model's
  EOS unless `ignore_eos`, and `stop_token_ids`) end the text without adding theirs.
- Every failure is a `ServeError` carrying a gRPC status, the matching HTTP status and an OpenAI error
  code, so both front ends report it the same way. A request the caller stops reading (a cancelled RPC,
  a closed HTTP connection) is aborted by `Generation.cancel()`, which frees its KV at the next step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Container, Protocol

import grpc
import torch

from llm_backend.engine import MEDIA_NEEDED, OverloadedError, PromptTooLong, SamplingParams
from llm_backend.engine.interfaces import Ticket
from mimo_epd.common.auth import client_interceptors
from mimo_epd.common.omni_prompt import ItemRows, LayoutError, OmniTokens, layout
from mimo_epd.common.prompt_rules import encode_text
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

from .detokenizer import IncrementalDetokenizer, StopMatcher
from .media_memo import MediaMemo, memo_key
from .media_transfer import EmbeddingReceiver, MediaTransferFailed

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ServeError(Exception):
    """A request's failure: `code` for gRPC, `http_status` for HTTP, `err_code`/`param` for OpenAI bodies."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        http_status: int | None = None,
        param: str | None = None,
        err_code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.code, self.message = code, message
        self.http_status = http_status or HTTP_STATUS.get(code, 500)
        self.param, self.err_code, self.retry_after = param, err_code, retry_after

    @staticmethod
    def invalid(message: str, param: str | None = None, err_code: str | None = None) -> ServeError:
        return ServeError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param, err_code=err_code)


def media_error(code: grpc.StatusCode, details: str, names: list[str] | None = None) -> ServeError:
    """The encoder's status as the API reports it: a size limit is 413, the encoder at capacity 429. With the
    request's `names` of its items (the field of each, then what it is of that field: `AUDIO_TRACK`), an
    "item N: ..." reply names the item in its message and its field as `param`."""
    details = details or code.name
    param = "media"
    m = re.match(r"item (\d+): ", details)
    if m and names and int(m[1]) < len(names):
        param = names[int(m[1])].split(", ")[0]
        details = f"item {m[1]} ({names[int(m[1])]}): {details[m.end() :]}"
    status = None
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED) and (
        "larger than the limit" in details or "over the limit" in details
    ):
        status = 413
    retry = 1.0 if code == grpc.StatusCode.RESOURCE_EXHAUSTED and status is None else None
    return ServeError(
        code, f"encoder: {details}", http_status=status, param=param, retry_after=retry, err_code="media_error"
    )


AUDIO_TRACK = ", its audio track (use_audio_in_video)"  # appended to a video's name for its soundtrack


def with_audio_tracks(items) -> tuple[list[encoder_pb2.MediaItem], list[str]]:
    """The media items with each video followed by its soundtrack, an AUDIO item of the same source (Qwen2.5-Omni's
    `use_audio_in_video`), and the name of each (`media[i]`)."""
    out, names = [], []
    for i, it in enumerate(items):
        out.append(it)
        names.append(f"media[{i}]")
        if it.modality == encoder_pb2.VIDEO:
            track = encoder_pb2.MediaItem()
            track.CopyFrom(it)
            track.modality = encoder_pb2.AUDIO
            track.ClearField("video")
            track.content_hash = ""  # the video's hash names the same bytes, but a client may set it per item
            out.append(track)
            names.append(f"media[{i}]{AUDIO_TRACK}")
    return out, names


def soundtrack_flags(names: list[str] | None, n: int) -> list[bool]:
    """Which of a request's n media items are a video's soundtrack (use_audio_in_video), by their names."""
    return [bool(names) and i < len(names) and names[i].endswith(AUDIO_TRACK) for i in range(n)]


def placeholder_ids(content_key: str, n: int, vocab: int) -> list[int]:
    base = int(content_key[:15], 16)
    return [vocab + (base + j) % (1 << 40) for j in range(n)]


MEDIA_KIND = {encoder_pb2.IMAGE: "image", encoder_pb2.VIDEO: "video", encoder_pb2.AUDIO: "audio"}


@dataclass
class EncodedMedia:
    """A request's media as the encoder returned them: each item's placeholder ids (and video groups), and all
    their embedding rows in item order (None without media)."""

    items: list[ItemRows]
    table: torch.Tensor | None


@dataclass
class Prepared:
    prompt: list[int]
    media: dict[int, torch.Tensor]
    media_tokens: int
    arrival: float
    media_items: list = field(default_factory=list)  # the request's media items (a decode worker forwards them)
    prefill_address: str = ""  # the prefill worker the router chose (decode role; empty = the worker picks)
    # Media positions before this come from the prefix cache, without rows (the encoder was skipped: MediaMemo);
    # `media_names` and `timeout` are what encoding them after all needs (Generation, on MEDIA_NEEDED).
    media_span: int = 0
    media_names: list[str] | None = None
    timeout: float | None = None


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class Final:
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    media_tokens: int
    ttft_s: float
    e2e_s: float
    matched_stop: str | int | None = None
    accepted_prediction_tokens: int = 0  # speculative decoding: draft tokens the target accepted
    rejected_prediction_tokens: int = 0  # and rejected
    kv_transfer_bytes: int = 0  # decode role: KV bytes a prefill worker wrote for this request
    kv_transfer_s: float = 0.0  # and the seconds of those writes
    prefill_address: str = ""  # the prefill worker that computed the prompt ("" = this worker)
    kv_events_position: str = ""  # "EPOCH:SEQ" of the worker's KV-event log once this request was cached
    prefill_failed_address: str = ""  # a prefill worker whose transfer failed, after which this worker prefilled


@dataclass
class Result:
    """A whole generation, collected (the non-streaming responses)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    final: Final
    prompt_logprobs: list[float] = field(default_factory=list)  # of prompt tokens 1.. (prompt_logprobs requests)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def _field_of(message: str) -> str | None:
    """The request field a SamplingParams.validate message names (its first word), if it is one."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").isalpha() and head.islower() else None


class Ticketing(Protocol):
    """A worker role's ticket for each prepared request (the decode role's choice of prefill worker)."""

    def ticket(self, prep) -> Ticket | None: ...


class GenerationCore:
    def __init__(
        self,
        engine,
        encoder_address: str | None = None,
        metrics=None,
        default_max_tokens: int = 256,
        model_name: str = "",
        max_message_mb: int = 512,
        ticketing: Ticketing | None = None,
        engine_alive: Callable[[], bool] | None = None,
        kv_events_position: Callable[[], str] | None = None,
        omni: OmniTokens | None = None,
        receiver: EmbeddingReceiver | None = None,
        memo: MediaMemo | None = None,
    ):
        """`ticketing`: the worker role's ticket for each request (the decode role's, server/kv_transfer.py).
        `engine_alive`: whether the engine thread still runs. `kv_events_position`: "EPOCH:SEQ" of the worker's
        KV-event log, reported with each final ("" = no events published). `omni`: the checkpoint's media tokens
        (MiMo's omni prompt lays media out with them; None = rows right after the first token). `receiver`: media
        rows over the transfer engine (--encoder-transfer; None = in the encoder's reply). `memo`: media the encoder
        answered before, so a request whose media KV is cached skips it (media_memo.py; None = always encode)."""
        self.engine = engine
        self.omni = omni
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.model_name = model_name or getattr(engine, "model_name", "") or "tiny"
        self.encoder = None
        if encoder_address:
            ch = grpc.aio.insecure_channel(
                encoder_address,
                interceptors=client_interceptors(),  # the internal key, when the node's gRPC port wants one
                options=[
                    ("grpc.max_receive_message_length", max_message_mb << 20),
                    ("grpc.max_send_message_length", max_message_mb << 20),
                ],
            )
            self.encoder = encoder_pb2_grpc.EncoderStub(ch)
        self.receiver = receiver
        self.memo = memo
        self.ticketing = ticketing
        self._engine_alive = engine_alive
        self._kv_events_position = kv_events_position

    def engine_alive(self) -> bool:
        return self._engine_alive() if self._engine_alive is not None else True

    def kv_events_position(self) -> str:
        return self._kv_events_position() if self._kv_events_position is not None else ""

    # ------------------------------------------------------------------------------------ facts
    @functools.cached_property
    def grammars(self):
        """The structured-output compiler (llm_backend/agentic/grammar.py), built on first use."""
        from llm_backend.agentic.grammar import pool_for_engine

        return pool_for_engine(self.engine)

    async def grammar(self, spec):
        """The compiled grammar of a request's output constraint (None without one); a 400 naming the field when
        it does not compile, or not within --grammar-compile-timeout-s."""
        if spec is None:
            return None
        from llm_backend.agentic.grammar import GrammarError

        try:
            return await self.grammars.compile(spec)
        except GrammarError as e:
            raise ServeError.invalid(str(e), param=e.param, err_code="invalid_grammar") from None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def max_waiting(self) -> int:
        return self.engine.config.max_waiting

    def stats(self) -> dict:
        return self.engine.stats()

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The engine tokenizer's ids (BOS first where it has one); without special tokens for text that a
        chat template rendered with its own (as transformers tokenizes `apply_chat_template` output)."""
        return encode_text(self.tokenizer, text, add_special_tokens)  # the router computes them the same way

    def check_serving(self) -> None:
        if self.engine.loop_error is not None or not self.engine_alive():
            raise ServeError(
                grpc.StatusCode.UNAVAILABLE, f"the engine is down: {self.engine.loop_error or 'its loop stopped'}"
            )

    # ------------------------------------------------------------------------------------ media
    async def encode_media(
        self,
        items: list[encoder_pb2.MediaItem],
        timeout: float | None,
        names: list[str] | None = None,
        keys: list | None = None,
    ) -> EncodedMedia:
        """Each item's rows from the encoder, with its placeholder ids (derived from its content key) and, for a
        video, its temporal groups (what MiMo's omni prompt writes a timestamp for). `keys`: the items' memo keys
        when the caller has them (MediaMemo: learned from this answer)."""
        if not items:
            return EncodedMedia([], None)
        if self.encoder is None:
            raise ServeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "media items need an encoder: start the worker with --encoder ADDR",
                param="media",
            )
        resp, moved = await self._encode(items, timeout, names)
        soundtrack = soundtrack_flags(names, len(items))
        hidden = self.engine.model.config.hidden_size
        out, rows = [], []
        for i, (it, asked) in enumerate(zip(resp.items, items)):
            emb = moved.get(i)
            if emb is None:
                emb = torch.frombuffer(bytearray(it.embedding.data), dtype=getattr(torch, it.embedding.dtype)).view(
                    *it.embedding.shape
                )
                self.metrics.media_bytes.labels("grpc").inc(len(it.embedding.data))
            if emb.shape[-1] != hidden:
                raise ServeError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"media item {i}: embedding size {emb.shape[-1]} != the model's hidden size {hidden}",
                    http_status=400,
                    param="media",
                )
            kind = MEDIA_KIND.get(asked.modality, "image")
            groups: tuple[tuple[float, int], ...] = ()
            if kind == "video" and it.timestamps_s:
                per = emb.shape[0] // len(it.timestamps_s)
                groups = tuple((float(t), per) for t in it.timestamps_s)
            ids = placeholder_ids(it.content_key, emb.shape[0], self.vocab_size)
            out.append(ItemRows(kind, ids, groups, soundtrack[i], it.end_s))
            rows.append(emb)
        if self.memo is not None:
            self.memo.learn(keys or [memo_key(it) for it in items], out, resp.model)
        return EncodedMedia(out, torch.cat(rows))

    async def _encode(self, items, timeout: float | None, names) -> tuple[encoder_pb2.EncodeResponse, dict]:
        """The encoder's reply and the rows that came over the transfer engine, by item index. A transfer that
        fails (no room, the encoder died mid-transfer) costs one more Encode, for bytes in the reply."""
        hold = self.receiver is not None
        try:
            resp = await self.encoder.Encode(encoder_pb2.EncodeRequest(items=list(items), hold=hold), timeout=timeout)
            if not hold:
                return resp, {}
            try:
                moved, n, seconds = await self.receiver.take(resp.items, timeout)
            except MediaTransferFailed as e:
                log.warning("media rows over the transfer engine: %s; asking for them as bytes", e)
                self.metrics.media_fallbacks.labels(e.reason).inc()
                resp = await self.encoder.Encode(encoder_pb2.EncodeRequest(items=list(items)), timeout=timeout)
                return resp, {}
        except grpc.aio.AioRpcError as e:
            raise media_error(e.code(), e.details(), names) from None
        if n:
            self.metrics.media_bytes.labels("mooncake").inc(n)
            self.metrics.media_seconds.labels("mooncake").inc(seconds)
        return resp, moved

    def place_media(self, prompt: list[int], enc: EncodedMedia, param: str = "prompt") -> dict[int, torch.Tensor]:
        """The media rows by prompt position: each id >= the vocabulary must be one of the items' placeholder ids,
        and takes that id's row (whatever layout put it there; an id names its item's content and its row)."""
        if enc.table is None:
            return {}
        row_of = {t: j for j, t in enumerate(t for it in enc.items for t in it.ids)}
        out = {}
        for i, t in enumerate(prompt):
            if t >= self.vocab_size:
                j = row_of.get(t)
                if j is None:
                    raise ServeError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{param}: the media placeholders differ from this worker's encoding of the media",
                        param=param,
                    )
                out[i] = enc.table[j]
        return out

    def media_prompt(self, ids: list[int], enc: EncodedMedia, text: str | None, add_special_tokens: bool) -> list[int]:
        """The prompt with the media in it: MiMo's omni layout where the checkpoint names its media tokens
        (mimo_epd/common/omni_prompt.py), else every item's rows right after the first token."""
        if not enc.items:
            return ids
        if self.omni is None:
            return ids[:1] + [t for it in enc.items for t in it.ids] + ids[1:]

        def plain(s: str) -> list[int]:
            return self.encode_text(s, False)

        try:
            if text is None:
                return layout(self.omni, "", enc.items, plain, head=ids)
            head = self.encode_text("", True) if add_special_tokens else []
            return layout(self.omni, text, enc.items, plain, head=head)
        except LayoutError as e:
            raise ServeError.invalid(str(e), param="messages" if text is not None else "prompt") from None

    async def prepare(
        self,
        *,
        text: str | None = None,
        token_ids: list[int] | None = None,
        media_items=(),
        media_names: list[str] | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = None,
        ids_param: str = "prompt_token_ids",
    ) -> Prepared:
        arrival = time.monotonic()
        self.check_serving()
        if token_ids is not None:
            ids = self.check_token_ids(token_ids, ids_param)
        else:
            ids = self.encode_text(text or "", add_special_tokens)
        if not ids:
            raise ServeError.invalid("the prompt is empty", param="prompt")
        items = list(media_items)
        text = text if token_ids is None else None
        keys = [memo_key(it) for it in items] if self.memo is not None else None  # each item's bytes hashed once
        cached = self._from_cache(ids, keys, media_names, text, add_special_tokens)
        if cached is not None:
            prompt, span = cached
            n = sum(t >= self.vocab_size for t in prompt)
            return Prepared(prompt, {}, n, arrival, items, media_span=span, media_names=media_names, timeout=timeout)
        enc = await self.encode_media(items, timeout, media_names, keys)
        prompt = self.media_prompt(ids, enc, text, add_special_tokens)
        media = self.place_media(prompt, enc)
        return Prepared(prompt, media, len(media), arrival, items)

    def _from_cache(self, ids, keys, names, text, add_special_tokens) -> tuple[list[int], int] | None:
        """(the prompt, its media span) when every item was answered before and the prefix cache holds the prompt
        past its last media row: the rows are not needed (the engine checks again at admission)."""
        if self.memo is None or not keys:
            return None
        known = self.memo.lookup(keys, soundtrack_flags(names, len(keys)))
        if known is None:
            return None
        prompt = self.media_prompt(ids, EncodedMedia(known, None), text, add_special_tokens)
        span = max(i for i, t in enumerate(prompt) if t >= self.vocab_size) + 1
        if span >= len(prompt) or self.engine.cached_prefix_length(prompt) < span:
            return None
        if self.metrics is not None:
            self.metrics.media_skipped.inc(len(keys))
        return prompt, span

    async def media_rows(self, prep: Prepared) -> dict[int, torch.Tensor]:
        """The rows of a prepared prompt that went without them (media_span), encoded after all."""
        enc = await self.encode_media(list(prep.media_items), prep.timeout, prep.media_names)
        return self.place_media(prep.prompt, enc)

    def check_token_ids(self, ids, param: str, skip: Container[int] = ()) -> list[int]:
        """Client token ids as ints, each in [0, vocabulary) (positions in `skip`: media placeholders this worker
        computed itself); any other value is a 400 / INVALID_ARGUMENT naming the field and the position. One rule
        for every path that takes ids: gRPC Generate, the HTTP APIs, the P/D prefill control."""
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__"):
                raise ServeError.invalid(f"{param}[{i}] = {t!r} is not a token id", param=param)
            t = int(t)
            if i not in skip and not 0 <= t < self.vocab_size:
                raise ServeError.invalid(
                    f"{param}[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})", param=param
                )
            out.append(t)
        return out

    # ------------------------------------------------------------------------------------ run
    def make_params(
        self,
        max_tokens: int | None,
        prompt_len: int,
        *,
        ignore_eos: bool = False,
        stop_token_ids=(),
        top_logprobs: int = 0,
        **kw,
    ):
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise ServeError.invalid(
                f"the prompt has {prompt_len} tokens, but this worker holds at most {self.max_model_len} tokens "
                "per request (prompt + output; raise --kv-cache-tokens)",
                param="messages",
                err_code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise ServeError.invalid(
                f"this worker holds at most {self.max_model_len} tokens per request, but {prompt_len + max_tokens} "
                f"were asked for ({prompt_len} in the prompt, {max_tokens} in the completion); lower max_tokens",
                param="max_tokens",
                err_code="context_length_exceeded",
            )
        if top_logprobs:
            kw["logprobs"] = True
        params = SamplingParams(
            max_tokens=max_tokens,
            stop_token_ids=tuple(self.check_token_ids(stop_token_ids, "stop_token_ids")),
            ignore_eos=ignore_eos,
            top_logprobs=top_logprobs,
            **kw,
        )
        cfg = self.engine.config
        try:
            params.validate(cfg.max_tokens_limit, cfg.max_temperature, cfg.max_logit_bias)
        except ValueError as e:
            raise ServeError.invalid(str(e), param=_field_of(str(e))) from None
        vocab = self.vocab_size
        for t, _ in params.logit_bias:
            if t >= vocab:
                raise ServeError.invalid(
                    f"logit_bias: token {t} is outside the vocabulary [0, {vocab})", param="logit_bias"
                )
        return params

    def start(self, prep: Prepared, params, stop: list[str] | tuple[str, ...] = ()) -> Generation:
        """Admits the request (the engine refuses it beyond --max-waiting: 429 / RESOURCE_EXHAUSTED)."""
        self.check_serving()
        return Generation(self, prep, params, stop)

    async def generate(self, prep: Prepared, params, stop=()) -> Result:
        return await self._collect(self.start(prep, params, stop))

    async def generate_samples(self, prep: Prepared, params: list, stop=()) -> list[Result]:
        """Several samples of one prompt (`n`, `best_of`): the first prefills the prompt; the others start once its
        first token is out, so the prompt is in the prefix cache and they compute only their own tokens. One
        failure cancels the rest (their KV freed)."""
        first = self.start(prep, params[0], stop)
        tasks = [asyncio.ensure_future(self._collect(first))]
        try:
            started = asyncio.ensure_future(first.started.wait())
            await asyncio.wait({tasks[0], started}, return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            if tasks[0].done() and tasks[0].exception() is not None:
                return [tasks[0].result()]  # raises its error
            tasks += [asyncio.ensure_future(self._collect(self.start(prep, p, stop))) for p in params[1:]]
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def sample_events(self, prep: Prepared, params, stop, n: int, gens: list):
        """(sample index, event) of `n` samples of one prompt as they come (the streamed form of
        `generate_samples`): the first prefills the prompt, the others start once its first token is out (the prompt
        then in the prefix cache; sample i gets seed + i; only the first scores the prompt when prompt logprobs are
        asked). `gens` receives the started generations: the caller cancels them. A sample's failure is raised."""
        queue: asyncio.Queue = asyncio.Queue()
        if not gens:  # the caller may have started the first itself (its errors before a stream opens)
            gens.append(self.start(prep, params, stop))
        first = gens[0]
        pumps = [asyncio.ensure_future(_pump(0, first, queue))]
        try:
            finals, started = 0, n == 1
            while finals < n:
                if not started and (first.started.is_set() or finals):
                    for i in range(1, n):
                        seed = None if params.seed is None else params.seed + i
                        gens.append(self.start(prep, replace(params, seed=seed, prompt_logprobs=False), stop))
                        pumps.append(asyncio.ensure_future(_pump(i, gens[-1], queue)))
                    started = True
                i, ev = await _next_sample(queue, first, started)
                if isinstance(ev, BaseException):
                    raise ev
                if ev is None:
                    continue  # the first sample's first token: start the others
                finals += isinstance(ev, Final)
                yield i, ev
        finally:
            for t in pumps:
                t.cancel()

    async def _collect(self, gen: Generation) -> Result:
        text, ids, lps, tops = [], [], [], []
        try:
            async for ev in gen.events():
                if isinstance(ev, Final):
                    r = gen.r
                    return Result(
                        "".join(text), ids, lps, tops, ev, list(r.prompt_logprobs), list(r.prompt_top_logprobs)
                    )
                text.append(ev.text)
                ids += ev.token_ids
                lps += ev.logprobs
                tops += ev.top_logprobs
        finally:
            gen.cancel()
        raise AssertionError("unreachable: events() always ends with a Final")

    def abort(self, r, reason: str = "abort") -> None:
        """ "abort" frees the KV the request owns alone (prefilled prompt chunks stay in the prefix cache); "stop" (a
        stop string matched) finishes it normally, KV cached."""
        self.engine.abort(r, reason=reason)


class Generation:
    """One running request: `events()` yields `Chunk`s then one `Final`; `cancel()` aborts it if unfinished."""

    def __init__(self, core: GenerationCore, prep: Prepared, params, stop):
        self.core, self.prep, self.params = core, prep, params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        tok = core.tokenizer
        self.detok = IncrementalDetokenizer(tok, prep.prompt, core.vocab_size)
        self.stopper = StopMatcher(list(stop))
        self.want_top = params.top_logprobs
        self.done = False
        self.n_tokens = 0
        self.matched: str | int | None = None
        self.started = asyncio.Event()  # set when its first token arrived (generate_samples waits for it)

        self._submit(prep.media, prep.media_span)
        self.stop_ids = self.r.stop_ids  # stop_token_ids, and the model's EOS unless ignore_eos

    def _push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _on_token(self, r, t, lp) -> None:  # the engine thread: read this position's alternatives now
        self._push(("token", t, lp, list(r.top_logprobs[-1]) if self.want_top and r.top_logprobs else None))

    def _on_finish(self, r) -> None:
        self._push(("end", None, None, None))

    def _submit(self, media: dict, media_span: int) -> None:
        core, prep = self.core, self.prep
        try:
            self.r = core.engine.add_request(
                prep.prompt,
                self.params,
                media,
                on_token=self._on_token,
                on_finish=self._on_finish,
                ticket=core.ticketing.ticket(prep) if core.ticketing is not None else None,
                media_span=media_span,
            )
        except PromptTooLong as e:
            raise ServeError.invalid(str(e), param="messages", err_code="context_length_exceeded") from None
        except ValueError as e:
            raise ServeError.invalid(str(e)) from None
        except OverloadedError as e:
            if core.metrics is not None:
                core.metrics.rejected.inc()
            raise ServeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the worker is overloaded: {e}",
                retry_after=1.0,
                err_code="overloaded",
            ) from None

    async def _with_rows(self) -> bool:
        """After MEDIA_NEEDED (the prefix cache lost the media's KV before admission; no token was produced): the
        rows encoded after all and the request submitted again with them. False when that does not apply."""
        r = self.r
        if r.error_code != MEDIA_NEEDED or self.n_tokens or not self.prep.media_span:
            return False
        if self.core.metrics is not None:
            self.core.metrics.media_skip_misses.inc()
        self._submit(await self.core.media_rows(self.prep), 0)
        return True

    async def events(self):
        core, m = self.core, self.core.metrics
        last = None
        stopped = False
        while True:
            kind, t, lp, top = await self.queue.get()
            if kind == "end":
                if await self._with_rows():
                    continue
                break
            self.started.set()
            if stopped:
                continue  # sampled before the stop-string abort reached the engine
            now = time.monotonic()
            if m is not None:
                if last is None:
                    m.ttft.observe(now - self.prep.arrival)
                else:
                    m.itl.observe(now - last)
            last = now
            self.n_tokens += 1
            chunk = Chunk("", [t], [lp] if lp is not None else [], [top] if top is not None else [])
            if t in self.stop_ids:
                self.matched = t
                chunk.text, _ = self.stopper.push(self.detok.flush())
                chunk.text += self.stopper.flush()
                stopped = True  # the engine finishes it itself
            else:
                chunk.text, hit = self.stopper.push(self.detok.push(t))
                if hit:
                    stopped = True
                    self.matched = self.stopper.matched
                    core.abort(self.r, reason="stop")
            yield chunk
        self.done = True
        r = self.r
        reason = r.finish_reason or "abort"
        if reason == "error":
            if m is not None:
                m.finished.labels("error").inc()
            raise self._error()
        if not stopped:
            tail, hit = self.stopper.push(self.detok.flush())
            tail += self.stopper.flush() if not hit else ""
            if tail:
                yield Chunk(tail, [])
        finish = "stop" if stopped else ("length" if reason == "length" else reason)
        e2e = time.monotonic() - self.prep.arrival
        ttft = (r.first_token_at - self.prep.arrival) if r.first_token_at else e2e
        final = Final(
            finish,
            len(self.prep.prompt),
            r.cached_tokens,
            self.n_tokens,
            self.prep.media_tokens,
            max(ttft, 0.0),
            e2e,
            self.matched,
            r.stats.accepted_tokens,
            r.stats.drafted_tokens - r.stats.accepted_tokens,
            r.stats.kv_bytes,
            r.stats.transfer_s,
            r.stats.prefill_used,
            core.kv_events_position(),  # read after the engine cached the request (finish() before on_finish)
            r.stats.prefill_failed,
        )
        if m is not None:
            m.on_finish(final)
        yield final

    def _error(self) -> ServeError:
        r = self.r
        msg, code = r.error, r.error_code
        grpc_code = {
            "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
            "invalid": grpc.StatusCode.INVALID_ARGUMENT,
            "unavailable": grpc.StatusCode.UNAVAILABLE,  # a prefill worker failed before the first token
        }.get(code, grpc.StatusCode.INTERNAL)
        return ServeError(
            grpc_code, msg or "the request failed", retry_after=1.0 if code == "resource_exhausted" else None
        )

    def cancel(self) -> None:
        if not self.done and not self.r.finish_reason:
            log.info("request %d: the client went away; aborting it to free its KV", self.r.id)
            self.core.abort(self.r)
            if self.core.metrics is not None:
                self.core.metrics.finished.labels("abort").inc()


async def _pump(i: int, gen: Generation, queue: asyncio.Queue) -> None:
    try:
        async for ev in gen.events():
            await queue.put((i, ev))
            if isinstance(ev, Final):
                return
    except Exception as e:  # noqa: BLE001 - a sample's failure is the request's: raised by the reader
        await queue.put((i, e))


async def _next_sample(queue: asyncio.Queue, first: Generation, started: bool):
    """The next (index, event); (0, None) when the first sample's first token arrived and the others wait for it."""
    if started:
        return await queue.get()
    got = asyncio.ensure_future(queue.get())
    flag = asyncio.ensure_future(first.started.wait())
    done, _ = await asyncio.wait({got, flag}, return_when=asyncio.FIRST_COMPLETED)
    if got in done:
        flag.cancel()
        return got.result()
    got.cancel()
    return 0, None
