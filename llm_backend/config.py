"""Every setting of an LLM worker (`mimo-epd llm`, and `serve --llm-*`): one dataclass, one field per flag.

The CLI builds the flags from these fields (mimo_epd.common.flags), `LLM.from_config` builds the engine
from them, and `serve` passes them through to its workers, so each default is written here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimo_epd.common.auth import AuthConfig
from mimo_epd.common.flags import embedded, flag
from mimo_epd.common.http_server import EdgeConfig

_SERVE, _KV, _SCHED, _LIMITS = "LLM worker", "LLM KV cache", "LLM scheduling", "LLM limits"
_SPEC = "LLM speculative decoding"
_PD = "LLM prefill/decode disaggregation"
_PAR = "LLM model parallelism"


@dataclass
class LLMConfig:
    # --- serving -------------------------------------------------------------------------------
    model: str = flag(
        "tiny",
        "'tiny' (the shipped trained model), 'tiny-random' (seeded random weights, byte tokenizer) or a MiMo "
        "checkpoint directory (mimo_v2_flash or mimo_v2, original or transformers layout, bf16 or FP8; docs/model.md)",
        _SERVE,
    )
    host: str = flag("127.0.0.1", "address to listen on", _SERVE)
    port: int = flag(50061, "gRPC port (0 = pick a free one; the ready line tells which)", _SERVE)
    http_port: int = flag(0, "HTTP port of the OpenAI-compatible API (0 = pick a free one, -1 = off)", _SERVE)
    device: str = flag("cpu", "torch device (cpu, cuda, cuda:1)", _SERVE)
    dtype: str = flag(
        "auto",
        "weights, activations and KV: float32, bfloat16, float16 or auto (bfloat16 on CUDA, else float32)",
        _SERVE,
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    fp8_weights: str = flag(
        "auto",
        "an FP8 checkpoint's linear layers: keep (FP8 in memory, about half of bf16's bytes; the Triton FP8 GEMM on "
        "CUDA, dequantized per GEMM on a CPU), dequantize (once at load into --dtype) or auto (keep on CUDA, "
        "dequantize on a CPU, where per-GEMM dequantization decodes ~10x slower: docs/model.md)",
        _SERVE,
        choices=("auto", "keep", "dequantize"),
    )
    quantization: str = flag(
        "",
        "fp8: quantize a bf16 checkpoint's linear layers to 128x128 block FP8 at load (vLLM's --quantization fp8); "
        "empty = as stored",
        _SERVE,
        choices=("", "fp8"),
    )
    torch_threads: int = flag(0, "intra-op threads for the forward (0 = torch's default: every core)", _SERVE)
    encoder: str = flag(
        "", "encoder (or router) address for media items (empty = requests with media are refused)", _SERVE
    )
    encoder_transfer: str = flag(
        "",
        "media rows from encoders over Mooncake's transfer engine into a buffer registered once: tcp or rdma (the "
        "encoders need --embedding-transfer; an item they send as bytes is taken as bytes); empty = in the gRPC reply",
        _SERVE,
        choices=("", "tcp", "rdma"),
    )
    encoder_transfer_device: str = flag("", "RDMA device names for --encoder-transfer rdma (empty = auto)", _SERVE)
    encoder_transfer_buffer_bytes: int = flag(
        1 << 30,
        "the registered receive buffer for --encoder-transfer (a reply whose rows find no room comes again as bytes)",
        _SERVE,
    )
    media_memo_items: int = flag(
        4096,
        "media items whose encoder answer (content key, rows) this worker remembers, by their bytes: a request whose "
        "media KV the prefix cache holds then skips the encoder (0 = always encode)",
        _SERVE,
    )
    grace_period_s: float = flag(10.0, "on SIGTERM/SIGINT, seconds to let in-flight requests finish", _SERVE)
    edge: EdgeConfig = embedded(EdgeConfig)  # the HTTP API's limits (body size, timeouts, connections, CORS)
    auth: AuthConfig = embedded(AuthConfig)  # API keys (HTTP and gRPC) and TLS
    log_level: str = flag("info", "debug, info, warning or error", _SERVE)
    served_model_name: str = flag("", "model id in the HTTP API (empty = the model's name)", _SERVE)
    tokenizer: str = flag(
        "",
        "tokenizer.json file, or a directory holding one (empty = the checkpoint's; 'bytes' = one token per byte)",
        _SERVE,
    )
    max_model_len: int = flag(
        0,
        "longest sequence (prompt + output) a request may reach (0 = the model's max_position_embeddings, at most "
        "--kv-cache-tokens)",
        _SERVE,
    )
    chat_template: str = flag(
        "", "jinja chat template file overriding the checkpoint's (empty = the checkpoint's)", _SERVE
    )
    default_max_tokens: int = flag(256, "completion tokens of a chat request that sets no max_tokens", _SERVE)
    max_samples_per_request: int = flag(16, "largest n / best_of a request may ask for (samples of one prompt)", _SERVE)
    max_prompts_per_request: int = flag(
        64, "prompts one /v1/completions request may carry as a list (each answered as one choice, run at once)", _SERVE
    )
    responses_store_size: int = flag(
        1024,
        "Responses API answers kept for previous_response_id (the oldest dropped first; 0 = none kept)",
        _SERVE,
    )
    responses_store_ttl_s: float = flag(
        3600.0, "seconds a stored Responses API answer can be continued with previous_response_id", _SERVE
    )
    media_timeout_s: float = flag(60.0, "seconds the encoder may take for one request's media", _SERVE)
    grammar_compile_timeout_s: float = flag(
        10.0, "seconds a structured-output grammar may take to compile before the request gets a 400", _SERVE
    )
    grammar_cache_size: int = flag(256, "compiled grammars kept (LRU, keyed by a hash of the schema)", _SERVE)
    # --- model parallelism (docs/parallel.md) ---------------------------------------------------
    tensor_parallel_size: int = flag(
        1,
        "ranks one model replica is split over (vLLM's and SGLang's meaning): attention heads, MLPs and the "
        "vocabulary split, one process per rank on torch.distributed (gloo on CPUs, NCCL on GPUs)",
        _PAR,
        aliases=("tp",),
    )
    enable_expert_parallel: bool = flag(
        False,
        "with --tensor-parallel-size N (x --data-parallel-size M): each rank holds n_experts / (N x M) whole experts "
        "instead of a slice of each",
        _PAR,
    )
    data_parallel_size: int = flag(
        1,
        "data-parallel attention (SGLang's --enable-dp-attention): this many worker processes, each with the whole "
        "attention, its own scheduler, KV pools and requests, share the experts split over all of them (needs "
        "--enable-expert-parallel and --dist-init-addr; each started with its own --data-parallel-rank)",
        _PAR,
        aliases=("dp",),
    )
    data_parallel_rank: int = flag(0, "this worker's place among the --data-parallel-size DP ranks", _PAR)
    data_parallel_dispatch: str = flag(
        "all_to_all",
        "how a MoE layer's tokens reach the experts of the other DP ranks: all_to_all (each token to the ranks "
        "holding its experts, the sums sent back) or all_gather (every rank's tokens to every rank, the sums "
        "all-reduced)",
        _PAR,
    )
    data_parallel_poll_ms: float = flag(
        2.0,
        "while the DP group is busy, how often an idle DP rank asks the others whether one has work (every step runs "
        "on all DP ranks together: the bound this adds to a first token)",
        _PAR,
    )
    data_parallel_idle_poll_ms: float = flag(
        20.0,
        "while no DP rank has work the asking interval doubles from --data-parallel-poll-ms up to this (an idle "
        "group costs little CPU; the bound on a first token after idling)",
        _PAR,
    )
    nnodes: int = flag(
        1, "machines one replica spans (SGLang's --nnodes): --tensor-parallel-size / nnodes ranks each", _PAR
    )
    node_rank: int = flag(
        0,
        "this machine's place in the replica: 0 runs rank 0 (the worker: scheduler, API) and its node's ranks; "
        "k > 0 runs ranks k * N/nnodes .. only, no API, and exits when they do",
        _PAR,
    )
    dist_init_addr: str = flag(
        "",
        "HOST:PORT of node 0's torch.distributed TCP store (every node gives the same); empty = a free loopback port "
        "(one machine only)",
        _PAR,
    )
    dist_timeout_s: float = flag(
        30.0, "seconds a collective waits for a peer before the replica is declared down (its requests failed)", _PAR
    )
    dist_load_timeout_s: float = flag(
        900.0, "seconds every rank may take to join and load its shard before start-up fails naming it", _PAR
    )
    # --- KV cache ------------------------------------------------------------------------------
    kv_cache_tokens: int = flag(16384, "full-attention KV pool, tokens", _KV)
    swa_cache_tokens: int = flag(
        4096, "sliding-window KV pool, tokens (at least window + chunk + release interval)", _KV
    )
    page_size: int = flag(1, "full-pool page size, tokens (prefix-cache match granularity)", _KV)
    prefix_cache: bool = flag(True, "SWA-aware radix prefix cache", _KV)
    release_interval: int = flag(16, "decode steps between releases of SWA slots that left the window", _KV)
    # --- KV tiers (docs/kv-tiers.md) ------------------------------------------------------------
    host_kv_bytes: int = flag(
        0,
        "host KV tier, bytes (0 = off): device-evicted pages are kept there and stay matchable; at TP > 1 the "
        "replica's total, each rank holding its heads' share",
        _KV,
    )
    host_kv_policy: str = flag("lru", "host tier eviction: lru or fifo", _KV, choices=("lru", "fifo"))
    host_kv_write: str = flag(
        "back", "host tier writes: back (on device eviction) or through (on insert)", _KV, choices=("back", "through")
    )
    kv_store: str = flag(
        "",
        "shared KV tier: redis://host:port/db or mooncake://master:port[?metadata=URL&protocol=tcp] (empty = "
        "off); pages are content-addressed",
        _KV,
    )
    kv_store_write: str = flag(
        "insert",
        "shared KV tier writes: insert (a page when it enters the tree: other workers reuse it at once) or "
        "evict (when it leaves the tree)",
        _KV,
        choices=("insert", "evict"),
    )
    kv_store_ttl_s: int = flag(3600, "TTL of a page in the shared KV tier, seconds", _KV)
    kv_store_timeout_s: float = flag(
        0.5, "shared KV tier socket timeout; on an error it is skipped for --kv-store-retry-s", _KV
    )
    kv_store_retry_s: float = flag(5.0, "seconds the shared KV tier is skipped after an error", _KV)
    kv_store_segment_bytes: int = flag(
        1 << 30, "mooncake:// KV tier: bytes of this worker's memory lent to the store's pool", _KV
    )
    kv_store_buffer_bytes: int = flag(
        64 << 20, "mooncake:// KV tier: the registered buffer pages are read into and written from, bytes", _KV
    )
    swa_backfill: bool = flag(
        False, "SWA back-fill: a node-end SWA window goes to the host tier before SWA eviction tombstones it", _KV
    )
    swa_checkpoint_interval: int = flag(
        512,
        "denser SWA checkpoints: SWA trimming also keeps the window before the last multiple of this many "
        "tokens inside each cached span, a multiple of --page-size above the window (0 = node ends only)",
        _KV,
    )
    # --- scheduling ----------------------------------------------------------------------------
    chunk_size: int = flag(512, "prefill chunk, tokens", _SCHED)
    max_running: int = flag(16, "requests running at once", _SCHED)
    max_prefill_tokens: int = flag(
        8192,
        "prefill tokens per step, shared by the running prompts in --prefill-order (decode tokens always run; "
        "0 = no cap)",
        _SCHED,
    )
    prefill_order: str = flag(
        "fewest_left",
        "who takes the prefill budget first: fewest_left (fewest prompt tokens left minus --wait-penalty per "
        "second waited) or oldest (admission order; always with --fcfs)",
        _SCHED,
        choices=("fewest_left", "oldest"),
    )
    fcfs: bool = flag(False, "first come first served instead of fewest uncached tokens first", _SCHED)
    wait_penalty: float = flag(2048.0, "uncached tokens forgiven per second of waiting, so nothing starves", _SCHED)
    length_buckets: str = flag("65536,262144", "prompt-length bucket bounds; buckets take turns at admission", _SCHED)
    # --- speculative decoding (docs/llm.md) -----------------------------------------------------
    speculative_steps: int = flag(
        0,
        "MTP speculative decoding: draft tokens verified per decode step, at most the model's MTP layers (0 = off)",
        _SPEC,
    )
    speculative_layers: str = flag(
        "chain",
        "chain (draft step k uses MTP layer k) or first (MTP layer 1 reused for every step, as vLLM runs MiMo)",
        _SPEC,
        choices=("chain", "first"),
    )
    prefill_mtp: bool = flag(
        True, "run the MTP layers over prompt chunks too, so the first decode step drafts from the whole prompt", _SPEC
    )
    speculative_auto: bool = flag(
        True,
        "turn drafting off for a request or a step when the measured step costs and acceptance say it does not pay",
        _SPEC,
    )
    speculative_auto_margin: float = flag(
        0.1,
        "auto: drafting must save at least this fraction of a plain step's time (so the fit's noise does not turn it "
        "on where it only breaks even)",
        _SPEC,
    )
    # --- prefill / decode disaggregation (docs/pd.md) -------------------------------------------
    role: str = flag(
        "both",
        "both (prefill and decode here), prefill (computes prompts, writes their KV into decode workers) or decode "
        "(asks a prefill worker for each prompt's KV, then decodes)",
        _PD,
        choices=("both", "prefill", "decode"),
    )
    pd_prefill: str = flag(
        "",
        "decode role: prefill workers (host:port,...) used when a request names none (the router names one); "
        "empty = every prompt is prefilled here",
        _PD,
    )
    pd_protocol: str = flag("tcp", "KV transfer protocol of the Mooncake transfer engine: tcp or rdma", _PD)
    pd_device: str = flag("", "RDMA device names for the transfer engine (protocol rdma; empty = auto)", _PD)
    pd_transfer_timeout_s: float = flag(
        5.0,
        "decode role: seconds without news from the prefill worker after which a transfer fails and its reserved "
        "pages are freed",
        _PD,
    )
    pd_fence_timeout_s: float = flag(
        30.0,
        "decode role: a room given up on keeps its reserved slots until its prefill worker confirms it writes no more "
        "(KVTransfer/Release) or is gone; a prefill worker that answers neither for this long (it hangs) has them "
        "freed anyway, with a warning",
        _PD,
    )
    pd_retries: int = flag(
        1,
        "decode role: a request whose KV transfer fails before its first token (the prefill worker died, hung past "
        "--pd-transfer-timeout-s or refused the room) is prefilled here instead, at most this many times; the client "
        "sees a slower first token, not an error (0 = it fails with UNAVAILABLE)",
        _PD,
    )
    pd_local_prefill_tokens: int = flag(
        2048,
        "decode role: a prompt with at most this many tokens not in this worker's prefix cache is prefilled here "
        "(conditional disaggregation; -1 = never; the default from bench pd, docs/pd.md)",
        _PD,
    )
    # --- limits --------------------------------------------------------------------------------
    max_waiting: int = flag(
        1024,
        "requests queued and not yet running; beyond it new ones are refused (RESOURCE_EXHAUSTED / HTTP 429)",
        _LIMITS,
    )
    max_logit_bias: int = flag(300, "entries a request's logit_bias may have (OpenAI's limit)", _LIMITS)
    max_tokens_limit: int = flag(
        2**31 - 1,
        "largest max_tokens a request may ask for (a sequence also ends when the KV pool cannot hold it longer)",
        _LIMITS,
    )
    max_temperature: float = flag(100.0, "largest sampling temperature accepted", _LIMITS)

    def buckets(self) -> tuple[int, ...]:
        try:
            return tuple(sorted(int(x) for x in self.length_buckets.split(",") if x.strip()))
        except ValueError:
            raise ValueError(
                f"--length-buckets must be comma-separated integers, got {self.length_buckets!r}"
            ) from None

    def validate(self) -> None:
        self.edge.validate()
        for name in (
            "kv_cache_tokens",
            "swa_cache_tokens",
            "page_size",
            "chunk_size",
            "release_interval",
            "max_running",
            "max_waiting",
            "encoder_transfer_buffer_bytes",
            "max_tokens_limit",
            "grace_period_s",
            "max_temperature",
            "grammar_compile_timeout_s",
            "grammar_cache_size",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.host_kv_bytes < 0 or self.swa_checkpoint_interval < 0 or self.kv_store_ttl_s <= 0:
            raise ValueError("--host-kv-bytes and --swa-checkpoint-interval must be >= 0, --kv-store-ttl-s positive")
        if self.kv_store:
            from llm_backend.kv.tiers.store import store_scheme

            if store_scheme(self.kv_store) == "mooncake":
                from llm_backend.kv.tiers.mooncake_store import parse_url

                parse_url(self.kv_store)
        if self.kv_store_segment_bytes <= 0 or self.kv_store_buffer_bytes <= 0:
            raise ValueError("--kv-store-segment-bytes and --kv-store-buffer-bytes must be positive")
        if self.speculative_auto_margin < 0:
            raise ValueError(f"--speculative-auto-margin must be >= 0, got {self.speculative_auto_margin}")
        if self.speculative_steps < 0:
            raise ValueError(f"--speculative-steps must be >= 0, got {self.speculative_steps}")
        if self.torch_threads < 0 or self.wait_penalty < 0 or self.max_prefill_tokens < 0:
            raise ValueError("--torch-threads, --wait-penalty and --max-prefill-tokens must be >= 0")
        if self.pd_retries < 0 or self.media_memo_items < 0:
            raise ValueError("--pd-retries and --media-memo-items must be >= 0")
        if self.pd_transfer_timeout_s <= 0 or self.pd_fence_timeout_s <= 0 or self.pd_protocol not in ("tcp", "rdma"):
            raise ValueError(
                "--pd-transfer-timeout-s and --pd-fence-timeout-s must be positive and --pd-protocol tcp or rdma"
            )
        self._validate_parallel()
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"--role must be both, prefill or decode, got {self.role!r}")
        if self.http_port < -1:
            raise ValueError(f"--http-port must be -1 (off), 0 (any) or a port, got {self.http_port}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if any(b <= 0 for b in self.buckets()):
            raise ValueError("--length-buckets bounds must be positive")

    def _validate_parallel(self) -> None:
        n = self.tensor_parallel_size
        if n < 1 or self.dist_timeout_s <= 0 or self.dist_load_timeout_s <= 0:
            raise ValueError("--tensor-parallel-size must be >= 1 and --dist-timeout-s, --dist-load-timeout-s positive")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes or n % self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes} and --node-rank {self.node_rank}: nnodes must divide --tensor-parallel-size "
                f"{n} and 0 <= node-rank < nnodes"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
        if self.dist_init_addr and not _host_port(self.dist_init_addr):
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        self._validate_data_parallel()

    def _validate_data_parallel(self) -> None:
        m = self.data_parallel_size
        if self.data_parallel_dispatch not in ("all_to_all", "all_gather"):
            raise ValueError(
                f"--data-parallel-dispatch must be all_to_all or all_gather, got {self.data_parallel_dispatch!r}"
            )
        polls = 0 < self.data_parallel_poll_ms <= self.data_parallel_idle_poll_ms
        if m < 1 or not 0 <= self.data_parallel_rank < m or not polls:
            raise ValueError(
                f"--data-parallel-size {m} and --data-parallel-rank {self.data_parallel_rank}: size >= 1, "
                "0 <= rank < size, and 0 < --data-parallel-poll-ms <= --data-parallel-idle-poll-ms"
            )
        if m == 1:
            return
        need = [
            (not self.enable_expert_parallel, "needs --enable-expert-parallel (the experts split over the DP ranks)"),
            (not self.dist_init_addr, "needs --dist-init-addr HOST:PORT (DP rank 0's address, the same on every rank)"),
        ]
        for bad, why in need:
            if bad:
                raise ValueError(f"--data-parallel-size {m} {why}")

    def torch_dtype(self):
        import torch

        name = self.dtype if self.dtype != "auto" else ("bfloat16" if self.device.startswith("cuda") else "float32")
        return getattr(torch, name)


def _host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
