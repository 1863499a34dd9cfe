"""The offline engine and serving loop, with vLLM's API: `LLM(...).generate(prompts, SamplingParams(...))`.

It wires the parts: the KV pools and the SWA-aware radix cache (`kv/`), the scheduler (what runs next), the
model runner (forward + sampling), and a tokenizer. `run_forever` is the serving loop a worker runs in one
thread; requests come in through `add_request` from any thread and leave through their callbacks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import fields, replace
from typing import Any

import torch

from ..config import LLMConfig
from ..kv import fit_checkpoint_interval
from ..kv.build import KVLayout, build_kv
from ..kv.tiers import TieredRadixCache
from ..models import load_llm, model_config
from ..paged_attention import KVPools
from ..parallel.comm import SINGLE_RANK, Parallel
from ..parallel.data import DataParallel, moe_layers
from ..parallel.mirror import DP_FINISH, MirroredTier, ModelCall
from ..parallel.replica import Replica, ReplicaDown, spec_from_config
from ..parallel.shard import Shard, whole_kv_heads
from ..tokenizer import ByteTokenizer, load_tokenizer
from .interfaces import SchedulerRole, Ticket
from .request import PromptTooLong, Request, RequestOutput, SamplingParams, Usage
from .runner import ModelRunner
from .scheduler import build_scheduler
from .speculative import SpeculativeRunner

log = logging.getLogger(__name__)

# Keyword names of the engine's constructor that differ from the flag names (kept for the offline API).
_ALIASES = {"enable_prefix_cache": "prefix_cache", "wait_penalty_tokens_per_s": "wait_penalty"}


class LLM:
    def __init__(
        self,
        model="tiny",
        dtype: torch.dtype | None = None,
        config: LLMConfig | None = None,
        scheduler: SchedulerRole | None = None,
        **options,
    ):
        """`model`: "tiny", a checkpoint directory or a model object. `scheduler`: a worker role's scheduler (the
        prefill and decode roles, pd/), None for the plain one. Options are `LLMConfig` fields
        (`enable_prefix_cache` and `wait_penalty_tokens_per_s` are accepted for `prefix_cache` / `wait_penalty`,
        `length_buckets` as a tuple too)."""
        cfg = _config(config, model, options)
        cfg.validate()
        self.config = cfg
        full_size = cfg.kv_cache_tokens - cfg.kv_cache_tokens % cfg.page_size  # whole pages
        # Model parallelism (llm_backend/parallel): this process is rank 0, the other ranks are started here.
        self.replica = _start_replica(cfg, model, dtype, full_size)
        # Data-parallel attention (parallel/data.py): this process is one DP rank; the others are their own workers.
        self.data = _start_data_parallel(cfg, model) if self.replica is None else self.replica.data
        par = self.replica.par if self.replica is not None else SINGLE_RANK
        if self.data is not None and self.replica is None:
            par = Parallel(Shard(0, 1, True, cfg.data_parallel_rank, cfg.data_parallel_size), data=self.data)
        try:
            self.model = _load(cfg, model, dtype, par)
            if self.data is not None:
                self.data.ready()
        except BaseException:
            self.close()
            raise
        self.model_name = cfg.model if isinstance(model, str) else type(model).__name__
        mcfg = self.model.config
        self.tokenizer = load_tokenizer(cfg.model, cfg.tokenizer) if isinstance(model, str) else ByteTokenizer()
        if mcfg.eos_token_id is not None and not isinstance(model, str):
            self.tokenizer.eos_token_id = mcfg.eos_token_id if isinstance(mcfg.eos_token_id, int) else None
        _check_swa_pool(cfg, mcfg.window)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        p = next(self.model.parameters())
        self.pools = KVPools(par.shard.attention_config(mcfg), full_size, cfg.swa_cache_tokens, p.dtype, p.device)
        if self.replica is not None:
            self.replica.ready()  # closes the other ranks itself when one fails
        # The MTP layers' KV shares the SWA slots; added before the tiers are built on the pools (they copy it too).
        mtp_base = (
            SpeculativeRunner.reserve_layers(self.model, self.pools, cfg.swa_cache_tokens)
            if (cfg.speculative_steps)
            else -1
        )
        kv = build_kv(self._kv_layout(cfg, mcfg, full_size))
        self.full_pool, self.swa_pool, self.cache = kv.full_pool, kv.swa_pool, kv.cache
        # The tiered cache when a KV tier is on (it also feeds the runner's layer-by-layer loads), else None.
        self.tiers: TieredRadixCache | None = kv.cache if isinstance(kv.cache, TieredRadixCache) else None
        if self.tiers is not None:  # at TP > 1 every rank keeps its own heads' host rows (parallel/mirror.py)
            peers = MirroredTier(self.replica, whole_kv_heads(mcfg, self.pools.k)) if self.replica is not None else None
            self.tiers.attach(self.pools, peers)
        try:
            self.cache.swa_checkpoint_interval = _checkpoint_interval(cfg, mcfg.window)
        except ValueError as e:
            raise ValueError(f"--swa-checkpoint-interval: {e}") from None
        self.runner = self._runner(cfg, mtp_base)
        drafter = self.runner if isinstance(self.runner, SpeculativeRunner) else None
        # The plain scheduler, or the one a role gives (the prefill and decode roles, pd/: composed by the worker
        # that runs them, so the engine never imports them).
        self.scheduler = build_scheduler(scheduler, kv, self.wake, **self._scheduler_parts(cfg, drafter))
        self.max_model_len = self.scheduler.max_seq_len = _max_model_len(cfg, mcfg, self.scheduler.max_seq_len)
        self._eos = self._eos_ids()
        self._ids = itertools.count()
        self.loop_error: BaseException | None = None
        self.step_errors = 0
        self._dp_wait_s = cfg.data_parallel_poll_ms / 1000  # a DP rank's wait between asks while idle

    def close(self) -> None:
        """Stops the other ranks of a model-parallel replica (nothing to do on one rank)."""
        replica = getattr(self, "replica", None)  # absent when the constructor failed before it
        if replica is not None:
            replica.close()
            self.replica = None
        data = getattr(self, "data", None)
        if data is not None:
            data.close()
            self.data = None

    def _scheduler_parts(self, cfg: LLMConfig, drafter) -> dict:
        """The plain scheduler's keyword arguments from the flags."""
        return dict(
            chunk_size=cfg.chunk_size,
            max_running=cfg.max_running,
            enable_prefix_cache=cfg.prefix_cache,
            release_interval=cfg.release_interval,
            fcfs=cfg.fcfs,
            wait_penalty=cfg.wait_penalty,
            length_buckets=cfg.buckets(),
            max_prefill_tokens=cfg.max_prefill_tokens,
            prefill_order=cfg.prefill_order,
            drafter=drafter,
        )

    def _runner(self, cfg: LLMConfig, mtp_base: int) -> ModelRunner:
        """The model runner, or with --speculative-steps the one that drafts with the MTP layers and verifies.

        Disaggregated (docs/pd.md, "P/D with speculation"): the MTP layers' KV is moved with the rest (the pools of
        both roles hold it, so the transfer layout includes it, window-only like every sliding layer). A prefill
        worker therefore computes every MTP layer's entries over every prompt chunk, never deferred: it never
        drafts (one token per request), and what it sends must be computed, whatever the decode side drafts with."""
        if not cfg.speculative_steps:
            return ModelRunner(self.model, self.pools, self.tiers, self.replica)
        steps, layers, prefill_mtp, auto = (
            cfg.speculative_steps,
            cfg.speculative_layers,
            cfg.prefill_mtp,
            cfg.speculative_auto,
        )
        mtp: Any = self.model.model.mtp  # reserve_layers checked it is there
        if cfg.role != "both":
            mtp_window = mtp.kv_config().window
            if mtp_window > self.model.config.window:
                raise ValueError(
                    f"--role {cfg.role} with --speculative-steps: the MTP layers' window {mtp_window} is longer than "
                    f"the model's {self.model.config.window}; the transfer moves the model's window only"
                )
        if cfg.role == "prefill":
            steps, layers, prefill_mtp, auto = len(mtp.layers), "chain", True, False
        return SpeculativeRunner(
            self.model,
            self.pools,
            self.swa_pool,
            mtp_base,
            steps,
            layers,
            prefill_mtp,
            auto,
            cfg.speculative_auto_margin,
            kv_loader=self.tiers,
            peers=self.replica,
        )

    def _kv_layout(self, cfg: LLMConfig, mcfg, full_size: int) -> KVLayout:
        """The pools and cache to build (kv/build.py): with a KV tier on (`--host-kv-bytes`, `--kv-store`) the host
        tier's bytes split between full and SWA KV in the device pools' proportion, and the shared store."""
        layout = KVLayout(full_size, cfg.swa_cache_tokens, cfg.page_size, mcfg.window)
        if not (cfg.host_kv_bytes or cfg.kv_store):
            return layout
        from ..kv.tiers import open_store
        from ..kv.tiers.host import token_bytes

        full_b, swa_b = token_bytes(self.pools)  # this rank's heads: at TP > 1 each rank holds 1/N of the bytes
        host_bytes = cfg.host_kv_bytes / cfg.tensor_parallel_size  # --host-kv-bytes is the replica's, all ranks
        dev_full, dev_swa = full_size * full_b, cfg.swa_cache_tokens * swa_b
        full_share = dev_full / max(dev_full + dev_swa, 1)
        store = None
        if cfg.kv_store:
            dtype = str(self.pools.k[0].dtype).removeprefix("torch.")
            ns = f"{self.model_name}:{mcfg.num_hidden_layers}:{mcfg.window}:{cfg.page_size}:{dtype}"
            store = open_store(
                cfg.kv_store,
                ns,
                ttl_s=cfg.kv_store_ttl_s,
                timeout_s=cfg.kv_store_timeout_s,
                retry_s=cfg.kv_store_retry_s,
                segment_bytes=cfg.kv_store_segment_bytes,
                buffer_bytes=cfg.kv_store_buffer_bytes,
            )
        return replace(
            layout,
            host_full_tokens=int(host_bytes * full_share) // max(full_b, 1),
            host_swa_tokens=int(host_bytes * (1 - full_share)) // max(swa_b, 1),
            policy=cfg.host_kv_policy,
            write_through=cfg.host_kv_write == "through",
            swa_backfill=cfg.swa_backfill,
            store=store,
            store_write=cfg.kv_store_write,
        )

    @classmethod
    def from_config(cls, config: LLMConfig, scheduler: SchedulerRole | None = None) -> "LLM":
        return cls(config.model, config=config, scheduler=scheduler)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for src in (self.model.config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(i for i in src if isinstance(i, int))
        return frozenset(ids)

    # ----------------------------------------------------------------------------------- views kept for callers
    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def admitted(self) -> list[int]:
        return self.scheduler.admitted

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def peak_swa_per_request(self) -> int:
        return self.scheduler.peak_swa_per_request

    def stats(self) -> dict:
        s = self.scheduler
        held = self.cache.accounting()
        return {
            # slots held by requests, outside the tree: 0 whenever the worker is idle (the failure tests read them)
            "full_request_slots": self.full_pool.size
            - self.full_pool.available()
            - held.full.evictable
            - held.full.protected,
            "swa_request_slots": self.swa_pool.size
            - self.swa_pool.available()
            - held.swa.evictable
            - held.swa.protected,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "full_used": self.full_pool.size - self.full_pool.available(),
            "full_total": self.full_pool.size,
            "swa_used": self.swa_pool.size - self.swa_pool.available(),
            "swa_total": self.swa_pool.size,
            "prefix_hit_tokens": self.cache.stats.hit_tokens,
            **self._parallel_stats(),
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "preemptions": s.preemptions,
            "step_errors": self.step_errors,
            **(self.tiers.tier_metrics() if self.tiers is not None else {}),
            **self.scheduler.metrics(),
            **self.runner.metrics(),
        }

    # ----------------------------------------------------------------------------------- public
    def generate(
        self,
        prompts: list[str] | str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts to the end (vLLM's offline API). With data-parallel attention it is collective: every DP
        rank makes the same calls (an empty `prompt_token_ids` where it has nothing) and each returns when no rank
        has work left."""
        params = sampling_params or SamplingParams()
        if prompt_token_ids is None:
            if prompts is None:
                raise ValueError("give prompts or prompt_token_ids")
            prompt_token_ids = [self.tokenizer.encode(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
        reqs = [self.add_request(ids, params) for ids in prompt_token_ids]
        if self.data is not None:  # collective: every DP rank calls it, it returns when no rank has work left
            while self._lockstep(self.has_work())[0]:
                pass
        while any(not r.finish_reason for r in reqs):
            self.step()
        return [self.output(r) for r in reqs]

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        media: dict[int, torch.Tensor] | None = None,
        on_token=None,
        on_finish=None,
        ticket: Ticket | None = None,
        media_span: int = 0,
    ) -> Request:
        """Queues a request. `media` maps prompt positions to embedding rows (their token ids are placeholders
        >= vocab_size derived from the media's content key, so equal media share prefixes). Raises ValueError
        (PromptTooLong when the prompt can never fit). `ticket`: what the worker's role needs of it (pd/).
        `media_span`: placeholders before this position come without rows, from the prefix cache (the caller saw
        them cached: `cached_prefix_length`); if the cache no longer holds them when the request is admitted, it
        ends at once with error_code MEDIA_NEEDED and no token, and the caller submits it again with the rows (so
        does a request that matches nothing: prompt_logprobs, or no prefix cache)."""
        params.validate(self.config.max_tokens_limit, self.config.max_temperature, self.config.max_logit_bias)
        vocab = self.model.config.vocab_size
        for t, _ in params.logit_bias:
            if t >= vocab:
                raise ValueError(f"logit_bias: token {t} is outside the vocabulary [0, {vocab})")
        media = media or {}
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if media_span and not 0 < media_span < len(prompt_ids):
            raise ValueError(f"media_span {media_span} is not a position inside the prompt")
        for p, t in enumerate(prompt_ids):
            if (
                isinstance(t, bool)
                or not isinstance(t, int)
                or not (0 <= t < vocab or ((p in media or p < media_span) and t >= vocab))
            ):
                raise ValueError(f"prompt token {p} = {t!r} is outside the vocabulary [0, {vocab})")
        self.scheduler.check_fits(len(prompt_ids))
        r = Request(
            next(self._ids),
            list(prompt_ids),
            params,
            time.monotonic(),
            media=media,
            media_span=media_span,
            on_token=on_token,
            on_finish=on_finish,
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos),
        )
        if params.grammar is not None:
            r.constraint = params.grammar.matcher()
        if params.seed is not None:
            r.generator = torch.Generator(device=self.pools.k[0].device).manual_seed(params.seed)
        with self._lock:
            if len(self.scheduler.waiting) >= self.config.max_waiting:
                raise OverloadedError(
                    f"{len(self.scheduler.waiting)} requests are waiting (--max-waiting "
                    f"{self.config.max_waiting}); retry later"
                )
            self.scheduler.add(r, ticket)
            self._wake.notify()
        return r

    def abort(self, r: Request, reason: str = "abort") -> None:
        """Stops a request at the next step. "abort" frees the KV slots it still owns alone; prompt chunks it
        already prefilled entered the prefix cache during prefill and stay there (shared, evictable like any cached
        prefix). "stop" ends it as a normal stop (server-side stop strings) and caches what it computed."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"abort reason must be abort or stop, got {reason!r}")
        r.aborted = r.aborted or reason
        with self._lock:
            self._wake.notify()

    def cached_prefix_length(self, tokens: list[int]) -> int:
        """How many leading tokens of a prompt the prefix cache holds now (window-safe, read-only: no LRU refresh,
        no statistics), as its admission would match them. The tree changes only under the engine's lock."""
        if not self.config.prefix_cache:
            return 0
        with self._lock:
            return self.cache.peek_prefix_length(list(tokens[:-1]))

    def wake(self, fn=None) -> None:
        """Runs `fn()` (if given) under the engine's lock and wakes the loop: news from outside the engine thread
        (a finished KV transfer) for the scheduler."""
        with self._lock:
            if fn is not None:
                fn()
            self._wake.notify()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run_forever(self, stop: threading.Event) -> None:
        """The serving loop (one thread): steps while there is work, sleeps otherwise. A failing step fails the
        requests of that step only; the loop goes on (`loop_error` is set only if the loop itself dies)."""
        try:
            while not stop.is_set():
                if self.data is not None:
                    if self._lockstep_serving(stop):
                        break
                    continue
                with self._lock:
                    if not self.has_work():
                        self._wake.wait(0.1)
                        self._check_replica()
                        continue
                self.step()
        except BaseException as e:  # pragma: no cover - step() contains its own failures
            self.loop_error = e
            log.exception("the engine loop died")
            raise

    def _lockstep_serving(self, stop: threading.Event) -> bool:
        """One turn of the serving loop of a DP rank: waits a while for work of its own (--data-parallel-poll-ms,
        doubling while the whole group idles), then runs a step with the others. True when this rank stops; when
        another one stops, the group cannot serve: this rank's requests fail (`unavailable`) and `ReplicaDown` ends
        its loop (the worker exits)."""
        cfg = self.config
        with self._lock:
            if not self.has_work():
                self._wake.wait(self._dp_wait_s)
                self._check_replica()  # at TP > 1: a local rank gone is noticed while idle too
        busy, stopping = self._lockstep(self.has_work(), stop.is_set())
        # Idle group: ask half as often each time, up to --data-parallel-idle-poll-ms (a spinning sync costs CPU).
        idle_wait = min(self._dp_wait_s * 2, cfg.data_parallel_idle_poll_ms / 1000)
        self._dp_wait_s = cfg.data_parallel_poll_ms / 1000 if busy else idle_wait
        if not stopping or stop.is_set():
            return stop.is_set()
        assert self.data is not None
        e = self.data.peer_stopped()
        self._fail_all("the data-parallel group", e)
        raise e

    def _lockstep(self, busy: bool, stopping: bool = False) -> tuple[bool, bool]:
        """Data-parallel attention (parallel/data.py): the DP ranks agree whether any has work (or is stopping);
        if one has, every rank runs its step (possibly empty) and then answers the others' MoE rounds until all
        are done. A DP group that went down fails this rank's requests (`unavailable`) and raises."""
        assert self.data is not None
        try:
            busy, stopping = self.data.sync(busy, stopping)
            if busy and not stopping:
                self.step()
                if self.replica is not None:  # this replica's other ranks shadow the rounds with it
                    self.replica.send(ModelCall(DP_FINISH, ()))
                self.data.finish(moe_layers(self.model), self.model.lm_head.weight)
        except ReplicaDown as e:
            self._fail_all("the data-parallel group", e)
            raise
        return busy, stopping

    def _parallel_stats(self) -> dict:
        """Model parallelism's figures (none on one rank): rank 0's collectives and the replica's state; with
        data-parallel attention this DP rank's rounds and the group's state."""
        if self.data is not None:
            out = self._expert_load(self.data.size * self.data.tp)
        elif self.replica is not None:
            out = self._expert_load(self.replica.spec.size)
        else:
            return {}
        if self.replica is not None:
            c = self.replica.par.stats
            out.update(
                tensor_parallel_size=self.replica.spec.size,
                tp_collectives=c.calls,
                tp_collective_s=round(c.seconds, 6),
                tp_collective_bytes=c.bytes,
                tp_replica_up=int(not self.replica.down),
            )
        if self.data is not None:
            d = self.data.stats
            out.update(
                data_parallel_size=self.data.size,
                data_parallel_rank=self.data.rank,
                dp_rounds=d.rounds,
                dp_shadow_rounds=d.shadow_rounds,
                dp_collective_s=round(d.seconds, 6),
                dp_expert_rows=d.expert_rows,
                dp_sent_rows=d.sent_rows,
                dp_steps=d.steps,
                dp_up=int(not self.data.down),
            )
        return out

    def _expert_load(self, size: int) -> dict:
        """Expert parallelism: tokens per expert summed over the MoE layers, and per rank (`size` ranks): the tokens
        this rank routes (every token of the replica; with data-parallel attention, its DP rank's own)."""
        counts = [m.expert_tokens for m in self.model.modules() if getattr(m, "held", None) is not None]
        if not counts:
            return {}
        per_expert = torch.stack(counts).sum(0).tolist()
        k = len(per_expert) // size
        return {
            "ep_expert_tokens": per_expert,
            "ep_tokens_per_rank": [sum(per_expert[r * k : (r + 1) * k]) for r in range(size)],
        }

    def _check_replica(self) -> None:
        """While idle: a rank process of this node that is gone takes the replica down now, not at the next
        request (ranks on other nodes are noticed by the next collective)."""
        if self.replica is not None and self.replica.missing():
            try:
                self.replica.fail(RuntimeError("found while idle"))
            except ReplicaDown as e:
                self._fail_all("the model-parallel replica", e)
                raise

    # ----------------------------------------------------------------------------------- one step
    def step(self) -> None:
        """One round: the scheduler picks the segments, the runner computes them, the scheduler books the result.
        An exception in the forward fails the requests of this step (with a clear error) and nothing else."""
        with self._lock:
            try:
                segments = self.scheduler.schedule()
            except Exception as e:  # noqa: BLE001 - a bug in the bookkeeping: fail what it touched, keep serving
                self._fail(list(self.scheduler.running) + self.scheduler.in_hand(), "scheduling", e)
                return
        if not segments:
            return
        try:
            results = self.runner.execute(segments)
        except ReplicaDown as e:  # a rank is gone: nothing can run here any more; fail everything, stop the loop
            self._fail_all("the model-parallel replica", e)
            raise
        except Exception as e:  # noqa: BLE001 - a request must never take the worker down
            with self._lock:
                self._fail([seg.request for seg in segments], "the forward", e)
            return
        with self._lock:
            try:
                self.scheduler.complete(segments, results)
            except Exception as e:  # noqa: BLE001
                self._fail([seg.request for seg in segments], "booking the step", e)

    def _fail_all(self, what: str, e: Exception) -> None:
        """Fails every running and waiting request (the replica or the DP group went down: nothing runs any more)."""
        with self._lock:
            s = self.scheduler
            if s.running or s.waiting:
                self._fail(list(s.running) + list(s.waiting), what, e)

    def _fail(self, requests: list[Request], what: str, e: Exception) -> None:
        """Fails `requests` (frees their KV) after an unexpected error in `what`; the loop goes on."""
        self.step_errors += 1
        log.exception("%s failed for %d requests; failing them", what, len(requests))
        code = "resource_exhausted" if isinstance(e, torch.OutOfMemoryError) else "internal"
        code = "unavailable" if isinstance(e, ReplicaDown) else code
        s = self.scheduler
        for r in requests:
            for queue in (s.running, s.waiting):
                if r in queue:
                    queue.remove(r)
            try:
                s.finish(r, "error", f"{what} failed: {type(e).__name__}: {e}", code)
            except Exception:  # noqa: BLE001 - its KV may be half released: drop the reference, keep serving
                log.exception("request %d: could not release its KV", r.id)
                r.kv = None
                r.finish_reason, r.error, r.error_code = "error", f"{what} failed: {e}", code
                if r.on_finish:
                    r.on_finish(r)

    def output(self, r: Request) -> RequestOutput:
        p = r.params
        return RequestOutput(
            request_id=r.id,
            prompt_token_ids=r.prompt,
            output_token_ids=r.output,
            text=self.tokenizer.decode(r.output),
            logprobs=r.logprobs if p.logprobs else None,
            prompt_logprobs=[None, *r.prompt_logprobs] if p.prompt_logprobs else None,
            usage=Usage(len(r.prompt), r.cached_tokens, len(r.output)),
            finish_reason=r.finish_reason,
        )


class OverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (RESOURCE_EXHAUSTED / HTTP 429)."""


__all__ = ["LLM", "OverloadedError", "PromptTooLong"]


def _config(config: LLMConfig | None, model, options: dict) -> LLMConfig:
    """The engine's LLMConfig: `config`, or the flags' defaults, with `options` (LLMConfig fields, and the offline
    API's aliases) over it."""
    known = {f.name for f in fields(LLMConfig)}
    kw: dict = {}
    for k, v in options.items():
        k = _ALIASES.get(k, k)
        if k not in known:
            raise TypeError(f"LLM() got an unexpected option {k!r}")
        kw[k] = ",".join(str(b) for b in v) if k == "length_buckets" and not isinstance(v, str) else v
    if isinstance(model, str):
        kw.setdefault("model", model)
    if config is None:
        return LLMConfig(**kw)
    return replace(config, **kw) if kw else config


def _check_swa_pool(cfg: LLMConfig, window: int) -> None:
    """The SWA pool must hold one request's window and a chunk; with fewer than --max-running windows it works, with
    preemptions (a warning says so)."""
    if cfg.swa_cache_tokens < window + cfg.chunk_size + cfg.release_interval + 1:
        raise ValueError(
            f"--swa-cache-tokens {cfg.swa_cache_tokens} cannot hold one request's window: need at "
            f"least window {window} + --chunk-size {cfg.chunk_size} + --release-interval "
            f"{cfg.release_interval} + 1"
        )
    busy = cfg.max_running * (window + cfg.release_interval) + cfg.chunk_size
    if cfg.swa_cache_tokens < busy:
        log.warning(
            "--swa-cache-tokens %d holds less than --max-running %d windows (%d + --release-interval %d each) "
            "plus one --chunk-size %d chunk (%d tokens): with that many requests running, a prompt chunk "
            "preempts a younger request to fit",
            cfg.swa_cache_tokens,
            cfg.max_running,
            window,
            cfg.release_interval,
            cfg.chunk_size,
            busy,
        )


def _max_model_len(cfg: LLMConfig, mcfg, pool_tokens: int) -> int:
    """The longest sequence a request may reach: what the model was trained for (max_position_embeddings), what
    the full pool holds, and --max-model-len when it asks for less; asking for more than the model's is an error."""
    trained = getattr(mcfg, "max_position_embeddings", None) or pool_tokens
    if cfg.max_model_len > trained:
        raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings {trained}")
    if cfg.max_model_len < 0:
        raise ValueError(f"--max-model-len must be >= 0 (0 = the model's), got {cfg.max_model_len}")
    return min(pool_tokens, trained, cfg.max_model_len or pool_tokens)


def _checkpoint_interval(cfg: LLMConfig, window: int) -> int:
    """The SWA checkpoint interval: a value the user set is used as is (the cache rejects one that is not a page
    multiple above the window); the default is rounded up to the first page multiple above the window, so a page
    size or a model window it does not fit never stops a worker from starting."""
    k = cfg.swa_checkpoint_interval
    default = next(f.default for f in fields(LLMConfig) if f.name == "swa_checkpoint_interval")
    if k != default:
        return k
    page = cfg.page_size
    fitted = fit_checkpoint_interval(k, window, page)
    if fitted != k:
        log.info(
            "SWA checkpoint interval %d -> %d (a multiple of the page size %d above the window %d)",
            k,
            fitted,
            page,
            window,
        )
    return fitted


def _start_replica(cfg: LLMConfig, model, dtype: torch.dtype | None, full_slots: int) -> Replica | None:
    """With --tensor-parallel-size N > 1: this node's other ranks started and every rank joined (each loads its
    shard meanwhile)."""
    if cfg.tensor_parallel_size == 1:
        return None
    if not isinstance(model, str):
        raise ValueError("--tensor-parallel-size > 1 needs a model name or directory (every rank loads its shard)")
    spec = spec_from_config(cfg, dtype, full_slots)
    spec.shard(0).check(model_config(cfg.model, cfg.device, cfg.fp8_weights, cfg.quantization))  # before any start
    replica = Replica(spec)
    replica.start()
    return replica


def _start_data_parallel(cfg: LLMConfig, model) -> DataParallel | None:
    """With --data-parallel-size M > 1: this DP rank joined to the others (each is its own worker process)."""
    if cfg.data_parallel_size == 1:
        return None  # (at --tensor-parallel-size > 1 the replica joins the DP group: replica.py)
    if not isinstance(model, str):
        raise ValueError("--data-parallel-size > 1 needs a model name or directory (every DP rank loads its experts)")
    shard = Shard(0, 1, True, cfg.data_parallel_rank, cfg.data_parallel_size)
    shard.check(model_config(cfg.model, cfg.device, cfg.fp8_weights, cfg.quantization))  # before joining the others
    data = DataParallel(
        cfg.data_parallel_rank,
        cfg.data_parallel_size,
        f"tcp://{cfg.dist_init_addr}",
        cfg.dist_timeout_s,
        cfg.dist_load_timeout_s,
        cfg.data_parallel_dispatch,
        device=cfg.device,
    )
    data.start()
    return data


def _load(cfg: LLMConfig, model, dtype: torch.dtype | None, par):
    if not isinstance(model, str):
        return model
    return load_llm(cfg.model, cfg.device, dtype or cfg.torch_dtype(), cfg.fp8_weights, cfg.quantization, True, par)
