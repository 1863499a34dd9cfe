"""MTP speculative decoding: draft with the model's multi-token-prediction layers, verify in the target's own
step, accept losslessly.

The MTP layers (models/mimo_v2_flash_mtp.py) form a chain: layer l (0-based) at a token slot s reads the hidden
state H_l(s - 1) (the main model's final hidden state for l = 0, layer l-1's output for l > 0) and the embedding of
the token at s, and its output predicts the token at s + 1. Its KV for slot s is stored in the request's SWA slot
of position s, in pool layers of their own appended after the main layers (`KVPools.add_sliding_layers`). So MTP
KV lives and dies with the sliding layers' KV: it is cached in the radix tree, released out of the window, moved
to the host or the store, and rolled back with it, and an entry at s depends only on tokens 0..s (a cached prefix
is a valid prefix for the MTP layers too). Layer l has no entry before slot `origin + l + 1`: origin 0 with prefill
MTP (the MTP layers run over every prompt chunk, so the first decode step already drafts from a full context), or
the prompt's last position without it (they see only what is generated).

One engine step of a speculating request whose last token t_L (at slot L) is not computed yet:
1. draft (`_draft`, before the main forward): chain mode runs layer l over slots [L, L + l]; the entry at L is a
   normal one, the others read the drafts d_1..d_l; the last entry's output gives d_{l+1}. `first` mode (one MTP
   layer reused for every step, the way vLLM runs MiMo) runs layer 0 at L, L + 1, ... each reading its own
   previous output. Drafts are argmax (greedy requests) or sampled from the MTP distribution with the request's
   temperature, top-k, top-p and generator (kept as q for verification).
2. verify: the segment's tokens [t_L, d_1..d_K] go through the target in the same batched forward as everyone
   else's prefill chunks and decode tokens. Greedy: the longest prefix where the target's argmax equals the
   draft, plus the target's token at the first difference (or after the last draft). Sampled: draft d at row i is
   accepted with probability min(1, p(d) / q(d)), p the target's distribution under the same settings; on a
   rejection the token comes from norm(max(p - q, 0)) and the run ends; all accepted adds a token from p at the
   last row (Leviathan et al. 2023; Chen et al. 2023). Either way the output has exactly the distribution of
   non-speculative decoding, and logprobs are the target's.
3. catch up (`_catch_up`, after the forward): every layer's entries for the positions this step made final
   (a prefill chunk, a plain decode token, or the accepted drafts) are recomputed from the target's hidden states,
   overwriting what drafting wrote there. The scheduler then rolls the rejected positions back (RequestKV.truncate).

Deferred catch-up: while the controller (spec_control.py) has drafting off, the catch-up over a request's final
positions is not run, its prompt chunks' included (prefill MTP deferred: with short answers the prompt is most of
the MTP work, and it pays only if the request drafts); the target's hidden states of those positions are kept
instead (`MTPState.pending`, at most the window's W rows: an MTP entry older than the window is never read again,
and its SWA slot is freed anyway). When the request drafts, the kept rows are caught up in one batched pass before
drafting (`_resume`), so its first draft still sees the prompt's last W positions, and a request that does not draft
costs the target's step alone. Whenever its KV enters the prefix cache (`before_cache`: a prompt chunk's checkpoint
while it runs, and its end) the SWA slots of its kept rows are marked stale (in the SWA pool: `SlotPool`'s stale
marks); a later request that hits that prefix starts its MTP attention after the last stale slot of its window
(`_stale_floor`, so it drafts from its own new tokens only: fewer accepted drafts at first, the same output), and a
catch-up that writes a slot clears its mark (the owner's resume, typically). A request that ends while not drafting
is never caught up. Invariant: no MTP attention reads a slot whose entry was not computed. Rows never computed are
counted as `spec_catch_up_skipped_tokens` (dropped past the window, or left stale:
`spec_catch_up_left_stale_tokens`). A stale mark is the SWA pool's (kv/pools.py): cleared when the slot is freed,
and carried with the slot's KV through the host tier and the shared store, so an entry restored from a tier is
exactly as valid as before.

Each request keeps `MTPState`: the next slot to fill and, per layer, the hidden input for it. A segment that does
not start there (a prefix-cache hit, a recomputation after preemption) has no H_l(start - 1) — no cache keeps hidden
states — and uses H_l(start) in its place for that one entry: an approximation that can only change how many
drafts are accepted, never the output.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ..kv import SlotPool
from ..paged_attention import KVPools, LayerOffset, PagedBatch, SeqSlots
from .interfaces import KVLoader
from .penalties import needs_adjusting
from .request import Request
from .runner import ModelRunner
from .sampler import SamplingError, check_finite, distribution
from .scheduler import Segment, SegmentResult
from .spec_control import SpecController
from .spec_state import MTPState, SpecStats, _Run
from .spec_verify import verify

DRAFT_LAYERS = ("chain", "first")

log = logging.getLogger(__name__)


class SpeculativeRunner(ModelRunner):
    @staticmethod
    def reserve_layers(model, pools: KVPools, swa_slots: int) -> int:
        """Adds the MTP layers' KV to `pools` (sliding layers over the SWA slots, module docstring) before anything
        is built on the pools (the KV tiers copy every layer); returns the first one's layer id."""
        mtp = getattr(model.model, "mtp", None)
        if mtp is None:
            raise ValueError("--speculative-steps needs a model with MTP layers (model.mtp.layers.* in its checkpoint)")
        return pools.add_sliding_layers(mtp.kv_config(), swa_slots)[0]

    def __init__(
        self,
        model,
        pools: KVPools,
        swa_pool: SlotPool,
        mtp_base: int,
        steps: int,
        layers: str = "chain",
        prefill_mtp: bool = True,
        auto: bool = True,
        auto_margin: float = 0.1,
        kv_loader: KVLoader | None = None,
        peers=None,
    ):
        """`pools` hold the MTP layers' KV from layer `mtp_base` on (`reserve_layers`); `swa_pool` keeps which SWA
        slots' MTP entries were never computed (its stale marks). `peers`: as `ModelRunner`'s."""
        mtp = getattr(model.model, "mtp", None)
        if mtp is None:
            raise ValueError("--speculative-steps needs a model with MTP layers (model.mtp.layers.* in its checkpoint)")
        n = len(mtp.layers)
        if not 1 <= steps <= n:
            raise ValueError(f"--speculative-steps {steps}: the model has {n} MTP layers (use 1..{n}, 0 = off)")
        if layers not in DRAFT_LAYERS:
            raise ValueError(f"--speculative-layers must be one of {', '.join(DRAFT_LAYERS)}, got {layers!r}")
        super().__init__(model, pools, kv_loader, peers)
        self.mtp, self.steps, self.layers, self.prefill_mtp = mtp, steps, layers, prefill_mtp
        self.depth = steps if layers == "chain" else 1  # MTP layers whose KV is kept
        self.window = mtp.kv_config().sliding_window  # MTP entries older than this are never read
        self.base = mtp_base
        self.stats = SpecStats(steps)
        self.control = SpecController(steps, auto=auto, margin=auto_margin)
        self._resume_s = 0.0  # this step's time resuming deferred catch-ups
        # SWA slots whose MTP entries were never computed (a request ended with deferred rows, before_cache) are
        # marked stale in the SWA pool: such a slot may be in the prefix cache (or a tier), and no MTP attention reads
        # it; a catch-up that writes it clears the mark, and so does freeing it.
        self.swa_pool = swa_pool
        self.states: dict[int, MTPState] = {}  # request id -> its MTP progress (while it holds KV)

    def metrics(self) -> dict:
        return {**{f"spec_{k}": v for k, v in self.stats.as_dict().items()}, "spec_control": self.control.as_dict()}

    def draft_tokens(self, r: Request) -> int:
        """The scheduler's question for a decoding request: how many draft positions to verify this step (K, or
        0 when its MTP state is not at its last token or the measured costs say drafting does not pay)."""
        st = self.states.get(r.id)
        if st is None or not st.ready or st.end != len(r.tokens) - 1:
            return 0
        st.wanted = self.control.wants(st)
        return self.steps if st.wanted else 0

    def release(self, r: Request) -> None:
        """The request ended: its MTP state (kept hidden rows included) goes with its KV."""
        self.states.pop(r.id, None)

    def before_cache(self, requests: list[Request]) -> list[bool]:
        """The scheduler's call before these requests' KV enters the prefix cache (a running request's prompt
        chunk, or a request's end). Deferred rows are not caught up for it: computing up to W rows through every
        MTP layer only for a later turn's drafts cost as much as a tenth of a request's decoding. Their slots are
        marked stale instead (the SWA pool's marks), so no other request's MTP attention reads them (`_stale_floor`);
        the rows stay kept, and a request that drafts later catches them up (clearing the marks). Always True."""
        for r in requests:
            st, kv = self.states.get(r.id), r.kv
            if st is None or kv is None or st.marked >= len(st.pending):
                continue
            self._mark_stale(kv, st.next_slot + st.marked, len(st.pending) - st.marked)
            st.marked = len(st.pending)
        return [True] * len(requests)

    def _mark_stale(self, kv, first: int, n: int) -> None:
        """Marks the live SWA slots of positions [first, first + n) stale: their MTP entries are not computed."""
        slots = [kv.swa[p] for p in range(first, min(first + n, len(kv.swa))) if kv.swa[p] is not None]
        self.swa_pool.mark_stale(slots)
        self.stats.left_stale += len(slots)

    def _stale_floor(self, r: Request, start: int) -> int:
        """The first slot a fresh MTP state at `start` may attend to: after the last stale one of the window
        before it (a cached prefix whose MTP entries were left uncomputed), else 0."""
        kv = r.kv
        if not self.swa_pool.stale_count or kv is None:
            return 0
        for p in range(start - 1, max(0, start - self.window) - 1, -1):
            s = kv.swa[p] if p < len(kv.swa) else None
            if s is not None and self.swa_pool.is_stale(s):
                return p + 1
        return 0

    # ----------------------------------------------------------------------------------- one step
    def execute(self, segments: list[Segment]) -> list[SegmentResult]:
        t0 = time.perf_counter()
        self._resume_s = 0.0
        with torch.inference_mode():
            results = self._execute(segments)
        decoding = sum(1 for s in segments if s.n - s.drafts == 1 and s.samples)
        drafting = sum(1 for s in segments if s.drafts)
        seconds = time.perf_counter() - t0 - self._resume_s  # resumes are timed apart (spec_control.py)
        self.control.observe(seconds, sum(s.n for s in segments), drafting > 0, decoding, drafting, len(segments))
        return results

    def _execute(self, segments: list[Segment]) -> list[SegmentResult]:
        verifying = [s for s in segments if s.drafts]
        if verifying:
            self._resume(verifying)
            self._draft(verifying)
        with self._batch(segments) as paged:
            hidden, bounds = self.model.hidden_states([self._inputs(s) for s in segments], paged)
        logits = []
        for j, s in enumerate(segments):
            h = hidden[bounds[j] : bounds[j + 1]]
            logits.append(self.model.logits(h if (s.drafts or s.all_logits) else h[-1:]))
        logits = self._masked(segments, logits)
        results = [self._verify(s, lg) if s.drafts else self._result(s, lg) for s, lg in zip(segments, logits)]
        self._catch_up(segments, [hidden[bounds[j] : bounds[j + 1]] for j in range(len(segments))], results)
        return results

    def _segment_tokens(self, seg: Segment) -> list[int]:
        own = super()._segment_tokens(seg)
        return own + self.states[seg.request.id].drafts if seg.drafts else own

    # ----------------------------------------------------------------------------------- MTP passes
    def _state(self, r: Request, start: int) -> MTPState:
        """The request's MTP state for a segment starting at `start` (a fresh one when it does not continue)."""
        st = self.states.get(r.id)
        if st is None or st.end != start:
            origin = 0 if self.prefill_mtp else max(0, len(r.prompt) - 1)
            st = MTPState(origin, start, [None] * self.depth, floor=self._stale_floor(r, start))
            self.states[r.id] = st
        return st

    def _run_layer(self, layer: int, runs: list[_Run]) -> None:
        """MTP layer `layer` over every run (one batched forward); sets each run's outputs."""
        runs = [u for u in runs if u.tokens]
        if not runs:
            return
        emb = self._embeddings(runs)
        hidden = torch.stack([h for u in runs for h in u.hidden]).to(emb.dtype)
        seqs: list[SeqSlots] = []
        positions: list[int] = []
        for u in runs:
            st, kv = self.states[u.request.id], u.request.kv
            assert st is not None and kv is not None
            o = st.first_slot(layer)  # the layer's sequence starts there (its positions count from it)
            lo = max(o, st.floor)  # ... and its attention from here
            seqs.append(SeqSlots(None, kv.swa[lo:], u.first - lo, len(u.tokens)))
            positions.extend(range(u.first - o, u.first - o + len(u.tokens)))
        paged = PagedBatch(self.pools, seqs)
        out = self.model.mtp_step(
            layer, emb, hidden, torch.tensor(positions, device=self.device), LayerOffset(paged, self.base)
        )
        k = 0
        for u in runs:
            u.out = out[k : k + len(u.tokens)]
            k += len(u.tokens)

    def _embeddings(self, runs: list[_Run]) -> torch.Tensor:
        """The token embeddings of every run's slots, media rows at their prompt positions (as the target's)."""
        vocab = self.model.config.vocab_size
        ids = torch.tensor([t for u in runs for t in u.tokens], device=self.device)
        emb = self.model.embed(ids.clamp(max=vocab - 1))
        k = 0
        for u in runs:
            media = u.request.media
            if media:
                for j in range(len(u.tokens)):
                    row = media.get(u.first + j)
                    if row is not None:
                        emb[k + j] = row.to(emb.dtype)
            k += len(u.tokens)
        return emb

    def _pick(self, r: Request, hidden: torch.Tensor, slot: int) -> tuple[int, torch.Tensor | None]:
        """The draft token for `slot` from an MTP output: argmax (greedy) or sampled with the request's settings
        (its distribution q kept for verification)."""
        logits = self.model.logits(hidden[None])[0]
        check_finite(logits)
        if r.params.greedy:
            return int(torch.argmax(logits)), None
        q = distribution(logits, r.params)
        return int(torch.multinomial(q, 1, generator=r.generator)), q

    def _draft(self, segments: list[Segment]) -> None:
        """Step 1 of the module docstring: `seg.drafts` tokens per verifying request (`state.drafts`)."""
        for s in segments:
            st = self.states[s.request.id]
            st.drafts, st.q, st.at_draft = [], [], [None] * self.depth
        prev: dict[int, _Run] = {}  # request id -> its run in the previous draft step
        for j in range(self.steps):
            layer = j if self.layers == "chain" else 0
            runs = []
            for s in segments:
                if j >= s.drafts:
                    continue
                r, st, L = s.request, self.states[s.request.id], s.start
                if self.layers == "chain":  # layer j at slots [L, L + j]
                    first = max(L, st.first_slot(layer))
                    hid = [self._h_draft(st, layer, L, prev.get(r.id), sl) for sl in range(first, L + j + 1)]
                else:  # layer 0 at L + j, reading its own previous output
                    first = L + j
                    h0 = st.inputs[0] if j == 0 else prev[r.id].out[-1]
                    assert h0 is not None, "a drafting request knows the hidden state before its last token"
                    hid = [h0]
                toks = [r.tokens[sl] if sl == L else st.drafts[sl - L - 1] for sl in range(first, L + j + 1)]
                runs.append(_Run(r, first, toks, hid))
            self._run_layer(layer, runs)
            for u in runs:
                st = self.states[u.request.id]
                token, q = self._pick(u.request, u.out[-1], u.first + len(u.tokens))
                st.drafts.append(token)
                if q is not None:
                    st.q.append(q)
                if self.layers == "chain" and layer + 1 < self.depth and u.first == self.states[u.request.id].next_slot:
                    st.at_draft[layer + 1] = u.out[0]  # O_layer(L) = H_{layer+1}(L), the next catch-up's input
                prev[u.request.id] = u

    def _h_draft(self, st: MTPState, layer: int, L: int, below: _Run | None, slot: int) -> torch.Tensor:
        """H_layer(slot - 1) while drafting: the state's input at L, else the layer below's output this step."""
        given = st.inputs[layer]
        if slot == L and given is not None:
            return given
        if layer == 0:
            raise RuntimeError("drafting needs the main model's hidden state before the last token")
        assert below is not None and below.out.numel()
        at = slot - 1 if slot > L else slot  # (the same slot's: the approximation of the module docstring)
        return below.out[at - below.first]

    # ----------------------------------------------------------------------------------- verification
    def _verify(self, seg: Segment, logits: torch.Tensor) -> SegmentResult:
        """Step 2: the accepted drafts and the target's next token (spec_verify.py)."""
        r = seg.request
        st = self.states[r.id]
        try:
            adjust = functools.partial(self.penalties.adjust, r) if needs_adjusting(r.params) else None
            accepted, bonus = verify(logits, st.drafts[: seg.drafts], st.q, r.params, r.generator, r.constraint, adjust)
        except SamplingError as e:
            return SegmentResult(None, [], str(e))
        self.stats.add(seg.drafts, len(accepted))
        self.control.accepted(st, len(accepted))
        return SegmentResult(bonus, [], accepted=tuple(accepted))

    # ----------------------------------------------------------------------------------- catch up
    def _catch_up(self, segments: list[Segment], hidden: list[torch.Tensor], results: list[SegmentResult]) -> None:
        """Step 3: every kept layer's entries for the slots this step made final, from the target's hidden states
        (deferred for requests that are not drafting, see the module docstring); then each state moves to the slot
        after them."""
        plans = []
        for s, h, res in zip(segments, hidden, results):
            if res.error:
                self.states.pop(s.request.id, None)
                continue
            r = s.request
            own = s.n - s.drafts
            if s.drafts:  # [L] + the accepted drafts; the entries at L were written while drafting
                st = self.states.get(r.id)
                final = [r.tokens[s.start]] + [a.token for a in res.accepted]
                plans.append((s, st, h, final, s.start + 1))
                continue
            st = self._state(r, s.start)
            if self._defers(st):
                self._keep(r, h[:own])
                continue
            if st.pending:  # caught up now: the kept rows first, then this segment's
                self._keep(r, h[:own], deferred=False)
                plans.append(self._pending_plan(r, new=own))
                continue
            plans.append((s, st, h, r.tokens[s.start : s.start + own], s.start))
        self._run_catch_up(plans)

    def _defers(self, st: MTPState) -> bool:
        """Whether this request's catch-up waits: the controller measures and has drafting off for it."""
        return self.control.auto and not (self.control.drafting and st.wanted)

    def _keep(self, r: Request, rows: torch.Tensor, deferred: bool = True) -> None:
        """Keeps a deferred segment's hidden states (copies: the step's tensor is freed), at most the window's."""
        st, kv = self.states.get(r.id), r.kv
        assert st is not None and kv is not None
        if deferred:
            self.stats.deferred += rows.shape[0]
        skip = rows.shape[0] - self.window - 1  # a long prompt chunk: only its last W rows (and one input) matter
        if skip > 0:
            self._drop(st, len(st.pending), r)  # everything kept before it falls out of the window
            self._mark_stale(kv, st.next_slot, skip)  # prompt slots stay live (and cached): never computed
            st.next_slot += skip
            rows = rows[skip:]
        st.pending.extend(rows.clone().unbind(0))
        drop = len(st.pending) - self.window
        if drop > 0:  # those entries would be out of the window before anything reads them
            self._drop(st, drop, r)

    def _drop(self, st: MTPState, n: int, r: Request | None = None) -> None:
        """Drops the first n kept rows: their entries are never computed, so no attention of this request reads
        them (`floor`); the first kept entry is computed with the approximation of the module docstring for layers
        above the first. Generated positions that leave the window lose their SWA slots; a prompt's stay live (and
        cached), so with `r` given those are marked stale for other requests."""
        if r is not None and r.kv is not None and n > st.marked:
            first = st.next_slot + st.marked
            self._mark_stale(r.kv, first, min(st.next_slot + n, len(r.prompt)) - first)
        if n:
            st.inputs = [st.pending[n - 1]] + [None] * (self.depth - 1)
        st.next_slot += n
        st.floor = st.next_slot
        st.marked = max(0, st.marked - n)
        del st.pending[:n]

    def _pending_plan(self, r: Request, new: int = 0):
        """A catch-up plan over the request's kept rows (those whose SWA slot is still live); the last `new` of
        them were kept this step and not deferred."""
        st, kv = self.states.get(r.id), r.kv
        assert st is not None and kv is not None
        live = next((j for j in range(len(st.pending)) if kv.swa[st.next_slot + j] is not None), len(st.pending))
        if live:  # released since (the window moved on): never read again
            self._drop(st, live)
        # The first kept entry's window reaches back W - 1 slots: attention starts after the last freed one.
        lo = max(st.floor, st.next_slot - self.window + 1, 0)
        freed = [p for p in range(lo, st.next_slot) if kv.swa[p] is None]
        if freed:
            st.floor = freed[-1] + 1
        rows, start = st.pending, st.next_slot
        st.pending = []
        self.stats.resumed += max(0, len(rows) - new)
        self.stats.left_stale -= sum(kv.swa[start + j] is not None for j in range(st.marked))  # computed after all
        st.marked = 0
        seg = Segment(r, start, len(rows))
        h = torch.stack(rows) if rows else torch.empty(0)
        return seg, st, h, r.tokens[start : start + len(rows)], start

    def _resume(self, segments: list[Segment]) -> None:
        """Before drafting: the deferred entries of the requests that draft again, in one batched pass (timed: the
        controller leaves it out of the step's cost)."""
        t0 = time.perf_counter()
        plans = [self._pending_plan(s.request) for s in segments if self.states[s.request.id].pending]
        plans = [p for p in plans if p[0].n]
        if not plans:
            return
        self._run_catch_up(plans)
        seconds = time.perf_counter() - t0
        self._resume_s += seconds
        self.control.resumed(sum(p[0].n for p in plans), seconds)

    def _run_catch_up(self, plans) -> None:
        """The catch-up passes (one batched pass per layer) over plans (segment, state, hidden, final tokens,
        first slot), then each state's inputs for its next slot."""
        outs: dict[int, dict[int, _Run]] = {}  # layer -> request id -> run
        for layer in range(self.depth):
            runs = []
            for s, st, h, final, start in plans:
                first = max(start, st.first_slot(layer))
                end = s.start + len(final)  # slots [first, end) get entries
                if first >= end:
                    continue
                r = s.request
                hid = [self._h_catch(st, layer, s, h, outs, sl, start) for sl in range(first, end)]
                runs.append(_Run(r, first, final[first - s.start :], hid))
            self._run_layer(layer, runs)
            outs[layer] = {u.request.id: u for u in runs}
        for s, st, h, final, _ in plans:
            if not final:
                continue
            if self.swa_pool.stale_count:  # computed now (slot s.start by the draft pass): valid again
                kv = s.request.kv
                assert kv is not None
                self.swa_pool.clear_stale(
                    x for x in (kv.swa[p] for p in range(s.start, s.start + len(final))) if x is not None
                )
            last = s.start + len(final) - 1  # the last final slot
            inputs: list[torch.Tensor | None] = [h[last - s.start]]
            for layer in range(1, self.depth):
                u = outs[layer - 1].get(s.request.id)
                if u is not None and u.first <= last:
                    inputs.append(u.out[last - u.first])
                elif s.drafts and last == s.start:
                    inputs.append(st.at_draft[layer])
                else:
                    inputs.append(None)
            st.inputs, st.next_slot, st.drafts, st.q = inputs, last + 1, [], []

    def _h_catch(self, st: MTPState, layer: int, s: Segment, h: torch.Tensor, outs, slot: int, start: int):
        """H_layer(slot - 1) while catching up."""
        prev = slot - 1
        if layer == 0:
            if prev >= s.start:
                return h[prev - s.start]
            return st.inputs[0] if st.inputs[0] is not None else h[slot - s.start]  # the approximation
        below = outs[layer - 1].get(s.request.id)
        if below is not None and below.first <= prev:
            return below.out[prev - below.first]
        if s.drafts and prev == s.start and st.at_draft[layer] is not None:
            return st.at_draft[layer]
        if st.inputs[layer] is not None and prev == st.next_slot - 1:
            return st.inputs[layer]
        assert below is not None and below.out.numel()
        return below.out[slot - below.first]  # the approximation: the same slot's
