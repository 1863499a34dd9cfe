"""The LLM worker's HTTP API (aiohttp): OpenAI chat completions and completions, models, health, the
endpoints an SGLang-style gateway reads at registration (`/get_model_info` = `/model_info`,
`/get_server_info` = `/server_info`, `/health`, `/health_generate`), SGLang's native `POST /generate`,
and Prometheus `/metrics`.

Every request runs through `GenerationCore` (the same path as gRPC Generate). Errors are OpenAI error
bodies with the status of the `ServeError` (429 with Retry-After when overloaded). Streams are SSE ending
with `data: [DONE]`; an error after the stream has started is sent as one `data: {"error": ...}` event.
A client that disconnects cancels its handler (handler_cancellation), which aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from dataclasses import replace

import grpc
from aiohttp import web

from llm_backend.agentic.output import ChatOutput
from mimo_epd.common import http_edge
from mimo_epd.common.auth import AuthConfig, ssl_context
from mimo_epd.common.http_server import EdgeConfig, edge_app, start_site

from . import anthropic_protocol as ap
from . import openai_protocol as proto
from . import responses_protocol as rp
from .chat_template import ChatTemplate, ChatTemplateError
from .core import Final, GenerationCore, ServeError

log = logging.getLogger(__name__)
JSON_HEADERS = {"Content-Type": "application/json"}


def error_response(e: ServeError) -> web.Response:
    headers = {}
    if e.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
    return web.json_response(
        proto.error_body(e.http_status, e.message, e.param, e.err_code), status=e.http_status, headers=headers
    )


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ServeError as e:
        if request.path.startswith("/v1/messages"):  # Anthropic's error shape: the same fields under type "error"
            resp = error_response(e)
            body = {"type": "error", **json.loads(resp.body)}  # type: ignore[arg-type]
            return web.json_response(
                body, status=resp.status, headers={k: v for k, v in resp.headers.items() if k == "Retry-After"}
            )
        return error_response(e)
    except ChatTemplateError as e:
        return error_response(ServeError.invalid(str(e), param="messages"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(
            proto.error_body(e.status, f"{e.reason}: {request.method} {request.path}"),
            status=e.status,
            headers={k: v for k, v in e.headers.items() if k == "Allow"},
        )


async def read_json(request: web.Request, edge: EdgeConfig):
    """The checked JSON body (http_edge: size after decompression, depth, strings); refusals are 4xx EdgeErrors."""
    return await http_edge.read_json(request, edge.max_request_bytes, edge.max_json_depth)


def _str_field(body: dict, key: str) -> str:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise ServeError.invalid(f"'{key}': expected a string", param=key)
    return v or ""


def _bool_field(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise ServeError.invalid(f"'{key}': expected true or false", param=key)
    return v


def _name(path: str) -> str:
    """A file or directory as its name: `/models/MiMo-V2.5/tokenizer.json` -> `MiMo-V2.5/tokenizer.json` (a
    checkpoint file keeps its directory's name), a directory -> its last component, a plain name unchanged."""
    if not path or os.sep not in path:
        return path
    norm = os.path.normpath(path)
    base = os.path.basename(norm)
    if os.path.isdir(norm) or "." not in base:
        return base
    return os.path.join(os.path.basename(os.path.dirname(norm)), base)


class LLMHTTPServer:
    def __init__(
        self,
        core: GenerationCore,
        template: ChatTemplate,
        metrics=None,
        media_timeout_s: float = 60.0,
        model_path: str = "tiny",
        edge: EdgeConfig | None = None,
        auth: AuthConfig | None = None,
        max_prompts: int = 64,
        max_samples: int = 16,
        responses: rp.ResponseStore | None = None,
    ):
        self.core, self.template, self.metrics = core, template, metrics
        self.edge = edge or EdgeConfig()
        self.auth = auth or AuthConfig()
        self.media_timeout_s = media_timeout_s
        # Clients see names, never this machine's paths (a checkpoint, a tokenizer, a template file): the info
        # endpoints answer anonymous clients when no --api-key is set.
        self.model_path = _name(model_path)
        self.max_prompts, self.max_samples = max_prompts, max_samples
        self.responses_store = responses or rp.ResponseStore()
        self.started = int(time.time())

    @web.middleware
    async def _count(self, request: web.Request, handler):
        """Per-endpoint metrics: each request counted by its route (unknown paths as `unmatched`, so a scan of
        made-up paths adds no series) and status, and timed to its answer's end."""
        t0 = time.monotonic()
        resource = getattr(request.match_info.route, "resource", None)
        endpoint = resource.canonical if resource is not None else "unmatched"
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            if self.metrics is not None:
                self.metrics.on_http(endpoint, status, time.monotonic() - t0)

    def app(self) -> web.Application:
        app = edge_app(self.edge, [self._count, errors_middleware], keys=self.auth.keys)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/messages", self.messages)
        r.add_post("/v1/responses", self.responses)
        r.add_post("/v1/messages/count_tokens", self.count_tokens)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{model}", self.model)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_post("/generate", self.generate)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/metrics", self.metrics_handler)
        return app

    # ------------------------------------------------------------------------------ info
    def _check_model(self, model: str) -> None:
        if model and model != self.core.model_name:
            raise ServeError(
                grpc.StatusCode.NOT_FOUND,
                f"model {http_edge.shown(model)} is not served here (this worker serves {self.core.model_name!r})",
                param="model",
                err_code="model_not_found",
            )

    def _model_card(self) -> dict:
        return {
            "id": self.core.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "mimo-epd",
            "root": self.model_path,
            "max_model_len": self.core.max_model_len,
        }

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        if request.match_info["model"] != self.core.model_name:
            raise ServeError(
                grpc.StatusCode.NOT_FOUND,
                f"model {http_edge.shown(request.match_info['model'])} is not served here",
                param="model",
                err_code="model_not_found",
            )
        return web.json_response(self._model_card())

    async def health(self, request):
        self.core.check_serving()
        return web.json_response({"status": "ok"})

    async def health_generate(self, request):
        prep = await self.core.prepare(text="ping")
        params = self.core.make_params(1, len(prep.prompt), ignore_eos=True)
        await self.core.generate(prep, params)
        return web.json_response({"status": "ok"})

    async def model_info(self, request):
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": _name(getattr(self.core.engine.tokenizer, "path", "") or self.model_path),
                "served_model_name": self.core.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": self.core.encoder is not None,
                "max_model_len": self.core.max_model_len,
            }
        )

    async def server_info(self, request):
        s = self.core.stats()
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.core.model_name,
                "tokenizer_path": _name(getattr(self.core.engine.tokenizer, "path", "") or self.model_path),
                "dp_size": 1,
                "tp_size": 1,
                "context_length": self.core.max_model_len,
                "max_total_num_tokens": s.get("full_total"),
                "max_running_requests": self.core.engine.config.max_running,
                "max_waiting": self.core.max_waiting,
                "chat_template": _name(self.template.origin),
                "internal_states": [s],
            }
        )

    async def metrics_handler(self, request):
        if self.metrics is None:
            raise web.HTTPNotFound()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    # ------------------------------------------------------------------------------ tokens
    async def tokenize(self, request):
        """vLLM's `POST /tokenize`: `prompt` (text, `add_special_tokens` default true) or chat `messages` rendered
        with the chat template exactly as /v1/chat/completions renders them (`add_generation_prompt` default true,
        `tools`, `chat_template_kwargs`, `use_audio_in_video`; media parts are encoded, so their rows count: their ids are the engine's
        placeholders, >= the vocabulary size). Returns `count`, `max_model_len`, `tokens` and, with
        `return_token_strs`, each token's string (null for a media row)."""
        body = await read_json(request, self.edge)
        if not isinstance(body, dict):
            raise ServeError.invalid("the request body must be a JSON object")
        self._check_model(_str_field(body, "model"))
        strs = _bool_field(body, "return_token_strs", False)
        if "messages" in body:
            keys = (
                "messages",
                "tools",
                "tool_choice",
                "chat_template_kwargs",
                "use_audio_in_video",
                "mm_processor_kwargs",
            )
            chat = {k: body[k] for k in keys if k in body}
            req = proto.parse_chat(chat)
            agp = _bool_field(body, "add_generation_prompt", True)
            text = self.template.render(req.messages, add_generation_prompt=agp, **req.agentic.render_kwargs())
            special = _bool_field(body, "add_special_tokens", False)
            prep = await self.core.prepare(
                text=text,
                media_items=req.media,
                media_names=req.media_names,
                add_special_tokens=special,
                timeout=self.media_timeout_s,
            )
            ids = prep.prompt
        elif isinstance(body.get("prompt"), str):
            ids = self.core.encode_text(body["prompt"], _bool_field(body, "add_special_tokens", True))
        else:
            raise ServeError.invalid("give 'prompt' (a string) or 'messages'", param="prompt")
        out = {"count": len(ids), "max_model_len": self.core.max_model_len, "tokens": ids, "token_strs": None}
        if strs:
            out["token_strs"] = [self._token_str(t) for t in ids]
        return web.json_response(out)

    async def detokenize(self, request):
        """vLLM's `POST /detokenize`: `tokens` (ids in the vocabulary) -> `prompt`, the decoded text."""
        body = await read_json(request, self.edge)
        if not isinstance(body, dict):
            raise ServeError.invalid("the request body must be a JSON object")
        self._check_model(_str_field(body, "model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise ServeError.invalid("'tokens': expected an array of token ids", param="tokens")
        ids = self.core.check_token_ids(tokens, "tokens")
        return web.json_response({"prompt": self.core.tokenizer.decode(ids)})

    def _token_str(self, t: int) -> str | None:
        if t >= self.core.vocab_size:
            return None  # a media row
        tok = self.core.tokenizer
        inner = getattr(tok, "tok", None)
        return inner.id_to_token(t) if inner is not None else tok.decode([t])

    # ------------------------------------------------------------------------------ generation
    async def _prepare(self, req: proto.GenRequest, prompt_logprobs: bool = False):
        core = self.core
        if req.kind == "chat":
            text = self.template.render(req.messages, add_generation_prompt=True, **req.agentic.render_kwargs())
            prep = await core.prepare(
                text=text,
                media_items=req.media,
                media_names=req.media_names,
                add_special_tokens=False,
                timeout=self.media_timeout_s,
            )
        else:
            prep = await core.prepare(
                text=req.text,
                token_ids=req.token_ids,
                media_items=req.media,
                timeout=self.media_timeout_s,
                ids_param="prompt",
            )
        params = core.make_params(
            req.max_tokens,
            len(prep.prompt),
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids,
            top_logprobs=req.top_logprobs,
            grammar=await core.grammar(req.agentic.constraint),
            prompt_logprobs=prompt_logprobs,
            **req.sampling,
        )
        return prep, params

    def _logprobs(self, req, ids, lps, tops, offset0=0):
        if not req.sampling.get("logprobs") or not lps:
            return None
        tok = self.core.tokenizer
        if req.kind == "chat":
            return proto.chat_logprobs(tok, ids, lps, tops)
        return proto.completion_logprobs(tok, ids, lps, tops, offset0)

    async def chat(self, request):
        req = proto.parse_chat(await read_json(request, self.edge), self.max_samples)
        return await self._run(request, req)

    async def completions(self, request):
        req = proto.parse_completion(await read_json(request, self.edge), self.max_prompts, self.max_samples)
        if len(req.prompts) == 1 and (
            req.stream or not (req.echo or req.prompt_logprobs is not None or req.best_of > 1)
        ):
            return await self._run(request, req)  # streamed: echo and prompt lists are refused by the parser
        return await self._score(req)

    async def _samples(self, req: proto.GenRequest, prep, params) -> list:
        """The `n` results of one prompt (of `best_of` candidates: the n with the highest cumulative logprob, in
        the order they were sampled); a seed gives sample i the seed + i."""
        if req.best_of == 1:
            return [await self.core.generate(prep, params, req.stop)]
        ranked = req.best_of > req.n
        each = [
            replace(params, seed=None if params.seed is None else params.seed + i, logprobs=params.logprobs or ranked)
            for i in range(req.best_of)
        ]
        results = await self.core.generate_samples(prep, each, req.stop)
        if not ranked:
            return results
        best = sorted(range(len(results)), key=lambda i: -sum(results[i].logprobs))[: req.n]
        return [results[i] for i in sorted(best)]

    async def _score(self, req: proto.GenRequest):
        """Completions for scoring and batches (lm-evaluation-harness's shape): every prompt of the list as one
        engine request, run at once; `echo` returns each prompt (and its logprobs, the first null) before its
        completion; `max_tokens: 0` with echo returns the prompt alone. Choices are indexed in prompt order."""
        self._check_model(req.model)
        want_prompt_lp = req.echo and bool(req.sampling.get("logprobs")) or req.prompt_logprobs is not None
        runs = []
        for text, ids in req.prompts:
            runs.append(await self._prepare(replace(req, text=text, token_ids=ids), prompt_logprobs=want_prompt_lp))
        tasks = [asyncio.ensure_future(self._samples(req, prep, params)) for prep, params in runs]
        try:
            per_prompt = await asyncio.gather(*tasks)
        except BaseException:  # one prompt failed (or the client left): the others are aborted, their KV freed
            for t in tasks:
                t.cancel()
            raise
        choices, finals = [], []
        for i, ((prep, _), results) in enumerate(zip(runs, per_prompt)):
            for j, res in enumerate(results):  # OpenAI's order: prompt i's samples at i * n + j
                choices.append(self._choice(i * req.n + j, req, prep.prompt, res))
            finals.append([res.final for res in results])
        body = proto.completion_batch(proto.new_id("cmpl"), self.core.model_name, choices, finals, req.score_only)
        return web.json_response(body)

    def _choice(self, index: int, req: proto.GenRequest, prompt: list[int], res) -> dict:
        """One prompt's choice: its completion (none when scoring only), echo and logprobs."""
        tok = self.core.tokenizer
        ids, lps, tops = list(res.token_ids), list(res.logprobs), list(res.top_logprobs)
        text = res.text
        if req.score_only:
            ids, lps, tops, text = [], [], [], ""
        logprobs = None
        if req.echo:
            prompt_text = self.core.tokenizer.decode(prompt)
            if req.sampling.get("logprobs"):
                logprobs = proto.echo_logprobs(
                    tok, prompt, res.prompt_logprobs, res.prompt_top_logprobs, ids, lps, tops
                )
            text = prompt_text + text
        elif req.sampling.get("logprobs"):
            logprobs = proto.completion_logprobs(tok, ids, lps, tops)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": res.final.finish_reason}
        if req.score_only:
            choice["finish_reason"] = "length"
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = proto.prompt_logprobs_entries(
                tok, prompt, res.prompt_logprobs, res.prompt_top_logprobs
            )
        return choice

    async def _run(self, request, req: proto.GenRequest):
        self._check_model(req.model)
        prep, params = await self._prepare(req)
        rid = proto.new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        model = self.core.model_name
        if req.stream:
            return await self._stream(request, req, prep, params, rid, model)
        if req.best_of > 1:  # chat with n > 1 (completions take the scoring path)
            return web.json_response(await self._chat_samples(req, prep, params, rid, model))
        res = await self.core.generate(prep, params, req.stop)
        lp = self._logprobs(req, res.token_ids, res.logprobs, res.top_logprobs)
        if req.kind == "chat":
            out = ChatOutput.whole(res.text, req.agentic.thinking, req.agentic.tools)
            body = proto.chat_response(
                rid, model, out.message(), out.finish_reason(res.final.finish_reason), res.final, lp
            )
        else:
            body = proto.completion_response(rid, model, res.text, res.final, lp)
        return web.json_response(body)

    async def _chat_samples(self, req: proto.GenRequest, prep, params, rid: str, model: str) -> dict:
        results = await self._samples(req, prep, params)
        choices = []
        for i, res in enumerate(results):
            out = ChatOutput.whole(res.text, req.agentic.thinking, req.agentic.tools)
            lp = self._logprobs(req, res.token_ids, res.logprobs, res.top_logprobs)
            body = proto.chat_response(
                rid, model, out.message(), out.finish_reason(res.final.finish_reason), res.final, lp
            )
            choices.append({**body["choices"][0], "index": i})
        body["choices"] = choices
        body["usage"] = proto.summed_usage([r.final for r in results], prompt_once=True)
        return body

    # ------------------------------------------------------------------------------ the Anthropic Messages API
    async def messages(self, request):
        """`POST /v1/messages` (server/anthropic_protocol.py): the chat path, Anthropic's shapes."""
        req = ap.parse_messages(await read_json(request, self.edge), self.max_samples)
        self._check_model(req.model)
        prep, params = await self._prepare(req)
        rid, model = ap.new_id(), self.core.model_name
        if req.stream:
            return await self._messages_stream(request, req, prep, params, rid, model)
        res = await self.core.generate(prep, params, req.stop)
        out = ChatOutput.whole(res.text, req.agentic.thinking, req.agentic.tools)
        finish = out.finish_reason(res.final.finish_reason)
        return web.json_response(ap.message_response(rid, model, out.message(), finish, res.final))

    async def count_tokens(self, request):
        """`POST /v1/messages/count_tokens`: the prompt tokens /v1/messages would send the model (media rows
        included), without generating."""
        req = ap.parse_messages(await read_json(request, self.edge), self.max_samples, require_max_tokens=False)
        self._check_model(req.model)
        prep, _ = await self._prepare(req)
        return web.json_response({"input_tokens": len(prep.prompt)})

    # ------------------------------------------------------------------------------ the OpenAI Responses API
    async def responses(self, request):
        """`POST /v1/responses` (server/responses_protocol.py): the chat path, the Responses API's shapes."""
        body = await read_json(request, self.edge)
        history = self.responses_store.get(body.get("previous_response_id")) if isinstance(body, dict) else None
        req, messages = rp.parse_responses(body, self.max_samples, history)
        self._check_model(req.model)
        prep, params = await self._prepare(req)
        rid, model = rp.new_id(), self.core.model_name
        if req.stream:
            return await self._responses_stream(request, body, (req, messages), prep, params, rid, model)
        res = await self.core.generate(prep, params, req.stop)
        out = ChatOutput.whole(res.text, req.agentic.thinking, req.agentic.tools)
        status = rp.status_of(out.finish_reason(res.final.finish_reason))
        output = rp.items(out.message(), status)
        stored = self.responses_store.put(rid, body, messages, out.message())
        return web.json_response(rp.response_object(rid, model, body, output, status, res.final, stored))

    async def _responses_stream(self, request, body, parsed, prep, params, rid: str, model: str) -> web.StreamResponse:
        req, messages = parsed
        gen = self.core.start(prep, params, req.stop)
        resp = await self._open_sse(request)
        out, si = ChatOutput(req.agentic.thinking, req.agentic.tools), rp.StreamItems()

        async def events() -> None:
            for name in ("response.created", "response.in_progress"):
                await self._event(
                    resp, *si.event(name, response=rp.response_object(rid, model, body, [], "in_progress", None))
                )
            final = await self._relay(resp, gen, out, si.push)
            status = rp.status_of(out.finish_reason(final.finish_reason))
            for name, data in si.close(status):
                await self._event(resp, name, data)
            stored = self.responses_store.put(rid, body, messages, out.message())
            done = rp.response_object(rid, model, body, si.output, status, final, stored)
            await self._event(resp, *si.event(f"response.{status}", response=done))

        return await self._named_stream(resp, gen, rid, events, si.error)

    @classmethod
    async def _relay(cls, resp: web.StreamResponse, gen, out: ChatOutput, push) -> Final:
        """Streams a generation's chat deltas (agentic/output.py) through `push` (a delta -> its named events: the
        Responses or the Messages API's shapes) as SSE events, the parser flushed at the end; returns the Final."""
        async for ev in gen.events():
            if isinstance(ev, Final):
                for d in out.flush():
                    for name, data in push(d):
                        await cls._event(resp, name, data)
                return ev
            for d in out.push(ev.text):
                for name, data in push(d):
                    await cls._event(resp, name, data)
        raise AssertionError("unreachable: events() always ends with a Final")

    @staticmethod
    async def _event(resp: web.StreamResponse, name: str, data: dict) -> None:
        await resp.write(f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

    async def _messages_stream(self, request, req, prep, params, rid: str, model: str) -> web.StreamResponse:
        gen = self.core.start(prep, params, req.stop)
        resp = await self._open_sse(request)
        out, sb = ChatOutput(req.agentic.thinking, req.agentic.tools), ap.StreamBlocks()
        start = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": []}
        start.update(stop_reason=None, stop_sequence=None, usage={"input_tokens": len(prep.prompt), "output_tokens": 0})

        async def events() -> None:
            await self._event(resp, "message_start", {"type": "message_start", "message": start})
            final = await self._relay(resp, gen, out, sb.push)
            for name, data in sb.close():
                await self._event(resp, name, data)
            reason, seq = ap.stop_reason(out.finish_reason(final.finish_reason), final)
            delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}}
            await self._event(resp, "message_delta", {**delta, "usage": {"output_tokens": final.completion_tokens}})
            await self._event(resp, "message_stop", {"type": "message_stop"})

        return await self._named_stream(resp, gen, rid, events, ap.error_event)

    @classmethod
    async def _named_stream(cls, resp: web.StreamResponse, gen, rid: str, events, error) -> web.StreamResponse:
        """Sends a stream of named SSE events (the Responses and the Messages APIs: `await events()`); a ServeError on
        the way becomes the API's own error event (`error(e)` -> (name, data)). A client that closes the stream first
        only cancels the request: its KV is freed and nothing is logged as an error."""
        try:
            await events()
        except ServeError as e:
            await cls._event(resp, *error(e))
        except ConnectionResetError:
            log.info("%s: the client closed the stream before its end; the request is cancelled", rid)
            return resp
        finally:
            gen.cancel()
        await resp.write_eof()
        return resp

    async def _open_sse(self, request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        await resp.write(f"data: {data}\n\n".encode())

    async def _stream(self, request, req, prep, params, rid, model):
        """A streamed chat or completion, `n` samples interleaved (each chunk's choice `index` says whose; the
        prompt prefilled once); with `stream_options.include_usage`, one usage chunk at the end for all of them."""
        gens = [self.core.start(prep, params, req.stop)]  # overload and prompt errors before the stream starts
        created = int(time.time())
        chat = req.kind == "chat"
        resp = await self._open_sse(request)
        outs = [ChatOutput(req.agentic.thinking, req.agentic.tools) for _ in range(req.n)]
        offsets = [0] * req.n

        def chunk(i: int, delta_or_text, finish=None, lp=None) -> dict:
            build = proto.chat_chunk if chat else proto.completion_chunk
            return build(rid, model, created, delta_or_text, finish, lp, include_usage=req.include_usage, index=i)

        async def events() -> None:
            if chat:
                for i in range(req.n):
                    await self._send(resp, chunk(i, {"role": "assistant", "content": ""}))
            finals = []
            async for i, ev in self.core.sample_events(prep, params, req.stop, req.n, gens):
                if isinstance(ev, Final):
                    finals.append(ev)
                    for d in outs[i].flush() if chat else []:
                        await self._send(resp, chunk(i, d))
                    finish = outs[i].finish_reason(ev.finish_reason) if chat else ev.finish_reason
                    await self._send(resp, chunk(i, {} if chat else "", finish))
                    continue
                lp = self._logprobs(req, ev.token_ids, ev.logprobs, ev.top_logprobs, offsets[i])
                offsets[i] += len(ev.text)
                if not ev.text and lp is None:
                    continue
                if not chat:
                    await self._send(resp, chunk(i, ev.text, None, lp))
                    continue
                deltas = outs[i].push(ev.text) or ([{"content": ""}] if lp is not None else [])
                for k, d in enumerate(deltas):
                    await self._send(resp, chunk(i, d, None, lp if k == 0 else None))
            if req.include_usage:
                body = proto.usage_chunk(
                    rid, model, created, "chat.completion.chunk" if chat else "text_completion", finals[0]
                )
                body["usage"] = proto.summed_usage(finals, prompt_once=True)
                await self._send(resp, body)

        return await self._run_stream(resp, gens, rid, events)

    @classmethod
    async def _run_stream(cls, resp: web.StreamResponse, gens: list, rid: str, events) -> web.StreamResponse:
        """Sends the stream's events (`await events()`), then `[DONE]`; a ServeError on the way becomes an error
        event. A client that closes the stream first (or the router in front, ending it while it drains) only
        cancels the request: its KV is freed and nothing is logged as an error."""
        try:
            try:
                await events()
            except ServeError as e:
                await cls._send(resp, proto.error_body(e.http_status, e.message, e.param, e.err_code))
            finally:
                for gen in gens:
                    gen.cancel()  # a no-op once finished; frees the KV of a request whose client went away
            await cls._send(resp, "[DONE]")
            await resp.write_eof()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError: the transport is closing
            log.info("%s: the client closed the stream before its end; the request is cancelled", rid)
        return resp

    async def generate(self, request):
        """SGLang's native API: `{"text", "output_ids", "meta_info"}`; streamed, each event has the text so far."""
        req = proto.parse_generate(await read_json(request, self.edge))
        prep, params = await self._prepare(req)
        rid = proto.new_id("gen")
        if not req.stream:
            res = await self.core.generate(prep, params, req.stop)
            meta = proto.generate_meta(rid, res.final, res.final.completion_tokens, len(prep.prompt))
            if req.sampling.get("logprobs"):
                meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(res.token_ids, res.logprobs)]
            return web.json_response({"text": res.text, "output_ids": res.token_ids, "meta_info": meta})
        gen = self.core.start(prep, params, req.stop)
        resp = await self._open_sse(request)
        text, ids = [], []

        async def events() -> None:
            nonlocal ids
            async for ev in gen.events():
                if isinstance(ev, Final):
                    await self._send(
                        resp,
                        {
                            "text": "".join(text),
                            "output_ids": ids,
                            "meta_info": proto.generate_meta(rid, ev, len(ids), len(prep.prompt)),
                        },
                    )
                    break
                text.append(ev.text)
                ids += ev.token_ids
                if ev.text:
                    await self._send(
                        resp,
                        {
                            "text": "".join(text),
                            "output_ids": ids,
                            "meta_info": proto.generate_meta(rid, None, len(ids), len(prep.prompt)),
                        },
                    )

        return await self._run_stream(resp, [gen], rid, events)


async def start_http(server: LLMHTTPServer, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Starts the app; returns the runner and the bound port. A client that disconnects cancels its handler."""
    return await start_site(server.app(), host, port, server.edge, ssl_context(server.auth))


async def stop_http(runner: web.AppRunner) -> None:
    await asyncio.wait_for(runner.cleanup(), 15)
