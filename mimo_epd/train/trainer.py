"""`mimo-epd train-tiny`: trains the shipped tiny MiMo-V2-Flash with its three MTP layers, on the CPU.

The run, top to bottom (every step seeded, so the same flags give the same checkpoint):
1. corpus: the documentation pages (`corpus.extract`), split into train and held-out pages (`corpus.split`);
2. tokenizer: a byte-level BPE learned on the train split (`tokenizer.train_tokenizer`);
3. samples: each epoch's plain-text and chat samples (`samples.build_samples`), tokenized, concatenated into one
   stream, cut into rows of `seq_len + 4` tokens at a stride of `seq_len`, the rows in a seeded order;
4. steps: the main model's next-token loss plus `mtp_weight` times each MTP layer's loss. MTP layer k reads the
   embedding of token t+k and the previous layer's hidden state at t (the main model's for k = 1) and predicts
   token t+1+k: a top-1 chain, as drafting runs it. AdamW, linear warm-up, cosine decay, gradient clipping;
   after each step every MoE layer's `e_score_correction_bias` moves by `bias_update` towards balanced expert
   loads (the auxiliary-loss-free balancing of the noaux_tc router: the bias only chooses experts);
5. every `checkpoint_every` steps the whole state (weights, optimizer, step, data position, RNG) goes to
   `work_dir/state.pt`, written atomically; a run started with the same `work_dir` resumes from it;
6. the end: weights rounded to bf16 (as shipped), the held-out figures measured on those, and the checkpoint
   directory written (`export.write_checkpoint`); one JSON object on stdout.

Progress (step, losses, learning rate, tokens/s) goes to stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from mimo_epd.common.flags import flag

MTP_DEPTH = 3
_NOT_IDENTITY = {"out", "work_dir", "checkpoint_every", "log_every", "threads", "stop_after"}


@dataclass
class TrainConfig:
    out: str = flag("", "the checkpoint directory to write (required)")
    work_dir: str = flag("", "where the resumable training state lives (default: OUT.work)")
    corpus_root: str = flag("/usr/share/doc/python3.11/html", "the HTML documentation to train on (python3.11-doc)")
    max_pages: int = flag(0, "use only the first N pages of the corpus (0 = all; for short test runs)")
    heldout_per_mille: int = flag(30, "share of pages held out for evaluation, per mille")
    seed: int = flag(0, "seed of the weights, the samples and their order")
    vocab_size: int = flag(4096, "BPE vocabulary size, special tokens included")
    hidden_size: int = flag(256, "model width (the tiny vision tower's output width follows it)")
    layers: int = flag(8, "decoder layers (full attention at 0 and every 6th, MiMo's rule)")
    intermediate_size: int = flag(512, "the dense MLP of layer 0 and of each MTP layer")
    moe_intermediate_size: int = flag(128, "each expert's MLP width")
    experts: int = flag(8, "routed experts per MoE layer")
    experts_per_token: int = flag(2, "experts each token uses")
    mtp_layers: int = flag(MTP_DEPTH, "MTP layers (MiMo-V2-Flash has 3)")
    mix: str = flag("qa=0.4,think=0.1,tool=0.2,json=0.1,hello=0.2", "the conversation kinds and their shares")
    plain_share: float = flag(0.5, "share of sections whose plain text is a sample (the rest give conversations only)")
    chats_per_section: int = flag(2, "conversations drawn per section and epoch")
    partial_rotary_factor: float = flag(
        0.34375, "share of head_dim that rotates (0.34375 x 64 = 22 dims, a whole even number as every release has)"
    )
    init_from: str = flag("", "start from the weights of this checkpoint directory (an earlier stage), not random ones")
    seq_len: int = flag(384, "tokens per training row")
    batch: int = flag(6, "rows per step")
    steps: int = flag(1300, "optimizer steps")
    lr: float = flag(2e-3, "peak learning rate")
    warmup: int = flag(50, "linear warm-up steps")
    min_lr_ratio: float = flag(0.1, "the cosine decay's floor, as a fraction of --lr")
    weight_decay: float = flag(0.1, "AdamW weight decay of matrices")
    mtp_weight: float = flag(0.3, "weight of each MTP layer's loss next to the main loss")
    mtp_stride: int = flag(2, "the MTP losses are taken at every N-th position (all positions are evaluated)")
    bias_update: float = flag(1e-3, "step of the router's load-balancing correction bias")
    checkpoint_every: int = flag(25, "steps between resumable checkpoints")
    eval_rows: int = flag(64, "held-out rows measured at the end")
    log_every: int = flag(10, "steps between progress lines on stderr")
    threads: int = flag(
        1, "torch CPU threads (0 = all cores; one thread is faster on a busy shared machine, no barrier waits)"
    )
    stop_after: int = flag(
        0, "save the resumable state and stop after N steps (0 = run to --steps); a later run resumes"
    )

    def validate(self) -> None:
        if not self.out:
            raise ValueError("--out is required: the checkpoint directory to write")
        for name in (
            "steps",
            "batch",
            "seq_len",
            "vocab_size",
            "checkpoint_every",
            "eval_rows",
            "log_every",
            "mtp_stride",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.plain_share <= 1:
            raise ValueError("--plain-share must be in [0, 1]")
        if self.chats_per_section < 0:
            raise ValueError("--chats-per-section must be at least 0")
        if not 0 <= self.mtp_layers <= 8:
            raise ValueError("--mtp-layers must be in [0, 8]")
        from .samples import parse_mix

        parse_mix(self.mix)

    def identity(self) -> dict:
        """The flags that decide the result (a resumed run must have the same ones)."""
        return {k: v for k, v in asdict(self).items() if k not in _NOT_IDENTITY}

    @property
    def state_dir(self) -> str:
        return self.work_dir or self.out.rstrip("/") + ".work"


def model_config(tc: TrainConfig, vocab_size: int):
    from llm_backend.models import MiMoV2FlashConfig

    from .tokenizer import SPECIAL

    return MiMoV2FlashConfig(
        vocab_size=vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        v_head_dim=32,
        sliding_window=129,
        moe_intermediate_size=tc.moe_intermediate_size,
        num_experts_per_tok=tc.experts_per_token,
        n_routed_experts=tc.experts,
        bos_token_id=SPECIAL.index("<|endoftext|>"),
        eos_token_id=[SPECIAL.index("<|im_end|>"), SPECIAL.index("<|endoftext|>")],
        num_nextn_predict_layers=tc.mtp_layers,
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": tc.partial_rotary_factor}
            for kind, theta in (("full_attention", 5_000_000.0), ("sliding_attention", 10_000.0))
        },
        max_position_embeddings=131072,
    )


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """N(0, 0.02) matrices, output projections scaled by 1/sqrt(2 * depth), norms at one, sinks and the
    correction bias at zero."""
    gen = torch.Generator().manual_seed(seed)
    depth = 2 * (model.config.num_hidden_layers + model.config.num_nextn_predict_layers)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("sinks"):
                p.zero_()
            else:
                std = (
                    0.02 / math.sqrt(depth)
                    if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight"))
                    else 0.02
                )
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


# ------------------------------------------------------------------------------------------------------- data


class Data:
    """The corpus, the tokenizer and the rows of each epoch (built on demand, cached for the current epoch)."""

    def __init__(self, tc: TrainConfig):
        from llm_backend.server.chat_template import ChatTemplate

        from . import corpus
        from .tokenizer import BOS, CHAT_TEMPLATE, IM_END, train_tokenizer

        self.tc = tc
        pages = corpus.extract(tc.corpus_root)
        if tc.max_pages:
            pages = pages[: tc.max_pages]
        self.train_pages, self.heldout_pages = corpus.split(pages, tc.heldout_per_mille)
        if not self.train_pages or not self.heldout_pages:
            raise ValueError("the corpus split left no train or no held-out page: use more pages (--max-pages)")
        texts = [s.text() for p in self.train_pages for s in p.sections]
        self.tokenizer = train_tokenizer(texts, tc.vocab_size)
        self.template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": BOS, "eos_token": IM_END})
        self._epoch: tuple[int, torch.Tensor] | None = None
        self._batches: dict[int, int] = {}  # epoch -> its number of whole batches
        self.heldout = self._rows(self.heldout_pages, epoch=0)[: tc.eval_rows]

    def _render(self, messages, **kw) -> str:
        return self.template.render(messages, **kw)

    def _rows(self, pages, epoch: int) -> torch.Tensor:
        from .samples import build_samples, parse_mix

        texts = build_samples(
            pages,
            self._render,
            self.tc.seed,
            epoch,
            parse_mix(self.tc.mix),
            plain_share=self.tc.plain_share,
            chats=self.tc.chats_per_section,
        )
        ids = [i for enc in self.tokenizer.encode_batch(texts) for i in enc.ids]
        stream = torch.tensor(ids, dtype=torch.long)
        n, width = self.tc.seq_len, self.tc.seq_len + 1 + self.tc.mtp_layers
        count = (stream.numel() - width) // n + 1
        return torch.stack([stream[r * n : r * n + width] for r in range(count)])

    def epoch_rows(self, epoch: int) -> torch.Tensor:
        """The train rows of `epoch`, in that epoch's seeded order."""
        if self._epoch is None or self._epoch[0] != epoch:
            rows = self._rows(self.train_pages, epoch)
            order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(self.tc.seed * 1000 + epoch))
            self._epoch = (epoch, rows[order])
            self._batches[epoch] = rows.shape[0] // self.tc.batch
        return self._epoch[1]

    def batch(self, index: int) -> torch.Tensor:
        """Batch `index` of the whole run (epochs follow one another; a partial last batch is skipped)."""
        epoch = 0
        while True:
            if epoch not in self._batches:
                self.epoch_rows(epoch)
            per_epoch = self._batches[epoch]
            if per_epoch == 0:
                raise ValueError("an epoch holds fewer rows than one batch: lower --batch or --seq-len")
            if index < per_epoch:
                rows = self.epoch_rows(epoch)
                return rows[index * self.tc.batch : (index + 1) * self.tc.batch]
            index -= per_epoch
            epoch += 1


# ------------------------------------------------------------------------------------------------------- loss


def losses(model, rows: torch.Tensor, depth: int, mtp_stride: int = 1):
    """rows [B, L + 1 + depth] -> (main loss, [MTP layer k's loss], each head's logits and targets, expert ids).
    The MTP layers run over every position (their attention needs them all); their LM head and loss over every
    `mtp_stride`-th position only (the shared 4096-wide head is the largest matmul of a step)."""
    from llm_backend.models.dense import logits, main_hidden, mtp_hidden

    n = rows.shape[1] - 1 - depth
    inputs = rows[:, :n]
    hidden, expert_ids = main_hidden(model, inputs)
    outs = [logits(model, hidden)]
    targets = [rows[:, 1 : n + 1]]
    emb = model.model.embed_tokens
    for k in range(1, depth + 1):
        hidden = mtp_hidden(model, k - 1, emb(rows[:, k : n + k]), hidden)
        outs.append(logits(model, hidden[:, ::mtp_stride]))
        targets.append(rows[:, 1 + k : n + 1 + k][:, ::mtp_stride])
    ce = [F.cross_entropy(o.reshape(-1, o.shape[-1]).float(), t.reshape(-1)) for o, t in zip(outs, targets)]
    return ce[0], ce[1:], outs, targets, expert_ids


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, depth: int, batch: int) -> dict:
    total, n_tok = 0.0, 0
    hits = [0] * depth
    for i in range(0, rows.shape[0], batch):
        main, _, outs, targets, _ = losses(model, rows[i : i + batch], depth)
        count = targets[0].numel()
        total += float(main) * count
        n_tok += count
        for k in range(depth):
            hits[k] += int((outs[k + 1].argmax(-1) == targets[k + 1]).sum())
    loss = total / max(n_tok, 1)
    return {
        "heldout_tokens": n_tok,
        "heldout_loss": round(loss, 4),
        "heldout_perplexity": round(math.exp(loss), 2),
        "mtp_top1_accuracy": [round(h / max(n_tok, 1), 4) for h in hits],
    }


def balance_router(model, expert_ids: list[torch.Tensor], step_size: float) -> None:
    """noaux_tc balancing: each MoE layer's correction bias rises for under-loaded experts, falls for over-loaded."""
    from llm_backend.models.mimo_v2_flash import MoE

    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    with torch.no_grad():
        for mlp, ids in zip(moes, expert_ids):
            load = torch.bincount(ids.reshape(-1), minlength=mlp.gate.e_score_correction_bias.numel()).float()
            mlp.gate.e_score_correction_bias.add_(step_size * torch.sign(load.mean() - load))


def learning_rate(tc: TrainConfig, step: int) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model, tc: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


# ------------------------------------------------------------------------------------------------------- run


class _Run:
    """One training run's state: the model, the optimizer, the data, and where it is."""

    def __init__(self, tc: TrainConfig):
        from llm_backend.models import MiMoV2FlashForCausalLM

        self.tc = tc
        torch.manual_seed(tc.seed)
        self.data = Data(tc)
        self.model = MiMoV2FlashForCausalLM(model_config(tc, self.data.tokenizer.get_vocab_size()))
        init_weights(self.model, tc.seed)
        if tc.init_from:
            self._init_from(tc.init_from)
        self.opt = make_optimizer(self.model, tc)
        os.makedirs(tc.state_dir, exist_ok=True)
        self.state_path = os.path.join(tc.state_dir, "state.pt")
        self.step, self.tokens, self.elapsed = 0, 0, 0.0
        self.depth = self.model.config.num_nextn_predict_layers

    def _init_from(self, directory: str) -> None:
        """The weights of an earlier stage's checkpoint; its tokenizer must be the one this corpus gives."""
        from llm_backend.models import load_llm

        tok_file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tok_file) or open(tok_file).read() != self.data.tokenizer.to_str(pretty=True):
            raise ValueError(f"--init-from {directory}: its tokenizer is not the one this corpus and --vocab-size give")
        state = load_llm(directory).state_dict()
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"--init-from {directory}: other shape ({(missing + unexpected)[:3]})")

    def resume(self) -> None:
        if not os.path.isfile(self.state_path):
            return
        state = torch.load(self.state_path, weights_only=False)
        if state["config"] != self.tc.identity():
            raise ValueError(f"{self.state_path} was written by a run with other flags; use another --work-dir")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.tokens, self.elapsed = state["step"], state["tokens"], state["seconds"]
        torch.set_rng_state(state["rng"])
        print(f"resumed at step {self.step} from {self.state_path}", file=sys.stderr, flush=True)

    def train_step(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        tc, model = self.tc, self.model
        rows = self.data.batch(self.step)
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(tc, self.step)
        main, mtp, _, _, expert_ids = losses(model, rows, self.depth, tc.mtp_stride)
        loss = main + tc.mtp_weight * sum(mtp, torch.zeros(()))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.opt.step()
        balance_router(model, expert_ids, tc.bias_update)
        self.step += 1
        self.tokens += rows.shape[0] * tc.seq_len
        return main, mtp

    def save(self, seconds: float) -> None:
        state = {
            "config": self.tc.identity(),
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "tokens": self.tokens,
            "seconds": seconds,
            "rng": torch.get_rng_state(),
        }
        tmp = self.state_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)


def _progress(tc: TrainConfig, step: int, main, mtp, tokens_per_s: float) -> None:
    print(
        f"step {step}/{tc.steps} loss {main.item():.4f} mtp "
        + " ".join(f"{x.item():.3f}" for x in mtp)
        + f" lr {learning_rate(tc, step - 1):.2e} tokens/s {tokens_per_s:.0f}",
        file=sys.stderr,
        flush=True,
    )


def train(tc: TrainConfig) -> dict:
    """Runs (or resumes) the training and writes the checkpoint directory; returns the final figures."""
    from .export import round_to_bf16, write_checkpoint

    tc.validate()
    t0 = time.monotonic()
    if tc.threads:
        torch.set_num_threads(tc.threads)
    run = _Run(tc)
    run.resume()
    run.model.train()
    run.data.batch(run.step)  # builds the first epoch's rows before the clock of the first progress line starts
    window_t, window_tok = time.monotonic(), run.tokens
    run_start = time.monotonic() - run.elapsed
    while run.step < tc.steps:
        main, mtp = run.train_step()
        if run.step % tc.log_every == 0 or run.step == tc.steps:
            now = time.monotonic()
            _progress(tc, run.step, main, mtp, (run.tokens - window_tok) / max(now - window_t, 1e-9))
            window_t, window_tok = now, run.tokens
        if (run.step % tc.checkpoint_every == 0 or run.step == tc.stop_after) and run.step < tc.steps:
            run.save(time.monotonic() - run_start)
            if run.step == tc.stop_after:
                print(f"stopped at step {run.step}; the state is in {run.state_path}", file=sys.stderr, flush=True)
                return {"stopped_at_step": run.step, "state": run.state_path}
    train_seconds = time.monotonic() - run_start
    model = run.model.eval()
    round_to_bf16(model)
    figures = evaluate(model, run.data.heldout, run.depth, tc.batch)
    write_checkpoint(model, run.data.tokenizer, tc.out)
    result = {
        **figures,
        "tokens_trained": run.tokens,
        "steps": tc.steps,
        "train_seconds": round(train_seconds, 1),
        "seconds": round(time.monotonic() - t0 + run.elapsed, 1),
        "tokens_per_s": round(run.tokens / max(train_seconds, 1e-9), 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    with open(os.path.join(tc.out, "training.json"), "w") as f:
        f.write(json.dumps({"config": tc.identity(), **result}, indent=2) + "\n")
    return result
