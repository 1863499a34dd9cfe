"""Prefill / decode pools in the fleet simulator: P prefill workers and D decode workers on one virtual clock, the
real `DecodeScheduler` (llm_backend/pd/decode.py) on the decode side and the real `Scheduler` on the prefill side,
and a network cost for each KV transfer.

Per request: the decode worker is picked by the routing policy over the decode workers (its predicted prefix is
its own cache's window-safe match, its load what it holds), the prefill worker by `prefill_policy` (default: the
same policy) over the prefill workers, whose own radix caches make a repeated prefix cheaper to prefill (the
prefill side's hit rate is reported as `prefill_cached_fraction`); a request whose uncached prompt is at most `local_prefill_tokens`, or that arrives while every prefill
worker has more than `max_prefill_queue` tokens queued, is prefilled on its decode worker (conditional
disaggregation, the decode scheduler's own rule). When the decode scheduler reserves the pages it starts the
transfer: the prompt is submitted to the prefill worker as a one-token request. When that finishes at time t, the
KV is in the decode worker's pools at

    done = t + latency + max(tail / bandwidth, bytes / bandwidth - prefill_time)

with `bytes` the transfer rule's (llm_backend/pd/rule.py: full-layer KV of the positions the decode side lacks, SWA
KV of the last W only), `tail` the bytes of the last chunk and `prefill_time` the prefill's admission to its end:
the writes of earlier chunks overlap the prefill chunk by chunk, only what the network could not keep up with and
the last chunk are added. Then the first token is appended and the request decodes there.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Callable

from llm_backend.pd.decode import DecodeRole, DecodeRoom, DecodeSettings, PDTicket
from llm_backend.pd.rule import TransferRule
from llm_backend.sim.cost import CostModel
from llm_backend.sim.engine import SimWorker, WorkerConfig
from llm_backend.sim.metrics import summarize
from llm_backend.sim.trace import SimRequest
from mimo_epd.router.policies import Candidate, RequestView, make_policy
from mimo_epd.v1 import pd_pb2


@dataclass(frozen=True)
class Network:
    bandwidth_gbit_s: float = 400.0  # one 400G NIC (RDMA) per worker
    latency_s: float = 0.0005  # handshake + completion of one transfer

    def seconds(self, nbytes: float) -> float:
        return nbytes * 8 / (self.bandwidth_gbit_s * 1e9)


class PrefillSimWorker(SimWorker):
    def _on_finish(self, r) -> None:
        """Records the request's admission time in its meta (the transfer's overlap with the prefill needs it)."""
        st = self.runner.states.get(r.id)
        if st is not None:
            st.spec.meta["admitted"] = r.admitted_at
        super()._on_finish(r)


class SimPort:
    """A decode worker's `TransferPort` in the simulator: a transfer submits the prompt to its prefill worker; the KV
    arrives as the port's "done" news at the time the network model gives. Simulated transfers never fail, so
    nothing is ever released."""

    def __init__(self, fleet: PDFleet, k: int):
        self.fleet, self.k = fleet, k

    def start(self, r, room: DecodeRoom, news: Callable[[str, object], None]) -> None:
        self.fleet._start(self.k, r, room, news)

    def release(self, room: DecodeRoom, released: Callable[[str], None]) -> None:
        released("simulated")


class PDFleet:
    def __init__(
        self,
        cost: CostModel,
        config: WorkerConfig,
        prefill: int,
        decode: int,
        policy: str = "affinity",
        network: Network | None = None,
        local_prefill_tokens: int = 0,
        max_prefill_queue: int = -1,
        prefill_policy: str | None = None,
        prefill_cost: CostModel | None = None,
        prefill_config: WorkerConfig | None = None,
    ):
        """`cost` / `config`: the decode workers' (and the prefill workers' unless `prefill_cost` / `prefill_config`
        give theirs: each role with its own parallelism, `bench pd`'s per-role modes). The units must agree."""
        self.cost, self.unit, self.net = cost, config.unit, network or Network()
        self.max_prefill_queue = max_prefill_queue
        pcost, pconfig = prefill_cost or cost, prefill_config or config
        if pconfig.unit != config.unit:
            raise ValueError(f"prefill unit {pconfig.unit} != decode unit {config.unit}")
        self.prefill = [PrefillSimWorker(pcost, pconfig, f"p{i}") for i in range(prefill)]
        settings = DecodeSettings(
            local_prefill_tokens=local_prefill_tokens // self.unit if local_prefill_tokens >= 0 else -1,
            transfer_timeout_s=float("inf"),
            fence_timeout_s=float("inf"),
            retries=0,  # simulated transfers never fail
        )
        self.decode = [
            SimWorker(cost, config, f"d{k}", role=DecodeRole(settings, SimPort(self, k))) for k in range(decode)
        ]
        self.policy = make_policy(policy)
        self.prefill_policy = make_policy(prefill_policy or policy)
        self.prefill_prompt_tokens = self.prefill_cached_tokens = 0
        self.events: list = []  # (time, seq, kind, payload)
        self._seq = 0
        self._kick: set[tuple[str, int]] = set()
        self.transfers: list[dict] = []
        self.now = 0.0

    # ------------------------------------------------------------------------------------------ routing
    def _rank(self, workers: list[SimWorker], spec: SimRequest, policy) -> int:
        cands = []
        for w in workers:
            load = w.load()
            hit = w.cache.peek_prefix_length(spec.prompt[:-1]) * self.unit
            cands.append(
                Candidate(
                    w.name,
                    min(hit, spec.prompt_len - 1),
                    load["queued_tokens"],
                    load["running_tokens"],
                    load["waiting"] + load["running"],
                )
            )
        view = RequestView(spec.prompt_len, self.unit, ())
        order = policy.rank(view, cands)
        return [w.name for w in workers].index(order[0])

    def _arrive(self, spec: SimRequest) -> None:
        k = self._rank(self.decode, spec, self.policy)
        p = self._rank(self.prefill, spec, self.prefill_policy) if self.prefill else -1
        lim = self.max_prefill_queue
        if p >= 0 and lim >= 0 and all(w.load()["queued_tokens"] > lim for w in self.prefill):
            p = -1
        self.decode[k].submit(spec, spec.arrival, PDTicket(prefill=str(p) if p >= 0 else ""))
        self._kick.add(("d", k))

    def _start(self, k: int, r, room, news: Callable[[str, object], None]) -> None:
        """The decode scheduler reserved the pages: the prompt goes to its prefill worker as a one-token request."""
        p = int(room.prefill)
        spec = SimRequest(
            -1,
            self.now,
            list(r.prompt),
            self.decode[k].runner.states[r.id].spec.prompt_len,
            1,
            meta={"pd": (k, r, room, news)},
        )
        self.prefill[p].submit(spec, self.now)
        self._kick.add(("p", p))

    def _prefilled(self, p: int, fin) -> None:
        k, r, room, news = fin.meta["pd"]
        self.prefill_prompt_tokens += fin.prompt_len
        self.prefill_cached_tokens += fin.cached_tokens
        sh, rule = self.cost.shape, room.rule
        U = self.unit
        page = self.decode[k].config.page_size
        real = TransferRule(fin.prompt_len, min(fin.prompt_len - 1, rule.decode_prefix * U), sh.window, page)
        nbytes = real.bytes(sh.kv_bytes_full, sh.kv_bytes_swa)
        chunk = self.prefill[p].config.chunk_size
        tail = nbytes * min(1.0, chunk / max(1, real.full_tokens))
        prefill_s = fin.first_token - fin.meta.get("admitted", fin.arrival)
        wire = self.net.seconds(nbytes)
        done = fin.first_token + self.net.latency_s + max(self.net.seconds(tail), wire - prefill_s)
        self.transfers.append(
            {
                "bytes": nbytes,
                "full_kv_bytes": real.full_kv_bytes(sh.kv_bytes_full, sh.kv_bytes_swa),
                "seconds": done - fin.first_token,
            }
        )
        # the message a real prefill worker sends last (pd.proto), so the simulator reads what the live path reads
        payload = pd_pb2.PrefillDone(first_token=0, logprob=0.0, kv_bytes=nbytes, transfer_s=wire, prefill_s=prefill_s)
        self._push(done, "kv", (k, r, news, payload))

    def _push(self, t: float, kind: str, payload) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    # ------------------------------------------------------------------------------------------ the clock
    def _worker(self, side: str, i: int) -> SimWorker:
        return self.prefill[i] if side == "p" else self.decode[i]

    def _kick_idle(self, t: float) -> None:
        while self._kick:
            side, i = self._kick.pop()
            w = self._worker(side, i)
            if not w.stepping and w.has_work():
                end = w.start_step(t)
                if end is not None:
                    self._push(end, "step", (side, i))

    def run(self, requests: list[SimRequest]) -> dict:
        arrivals = sorted(requests, key=lambda r: (r.arrival, r.index))
        for spec in arrivals:
            self._push(spec.arrival, "arrive", spec)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "arrive":
                self._arrive(payload)
            elif kind == "step":
                side, i = payload
                w = self._worker(side, i)
                seen = len(w.finished)
                w.end_step()
                self._kick.add((side, i))
                if side == "p":
                    for fin in w.finished[seen:]:
                        self._prefilled(i, fin)
                    del w.finished[seen:]
            else:  # the KV arrived
                k, r, news, done = payload
                w = self.decode[k]
                w.now = max(w.now, t)
                st = w.runner.states.get(r.id)
                if st is not None:  # the first token came from the prefill worker
                    st.kv, st.decoding, st.generated = r.kv, True, 1
                news("done", done)
                self._kick.add(("d", k))
            for side, i in list(self._kick):
                self._worker(side, i).now = max(self._worker(side, i).now, t)
            self._kick_idle(t)
        finished = [f for w in self.decode for f in w.finished]
        res = summarize(finished, [w.queue_samples for w in self.decode], [w.stats() for w in self.decode], 0)
        n = max(1, len(self.transfers))
        res["transfers"] = len(self.transfers)
        res["transfer_bytes_per_request"] = sum(x["bytes"] for x in self.transfers) / n
        res["full_kv_bytes_per_request"] = sum(x["full_kv_bytes"] for x in self.transfers) / n
        res["local_prefills"] = sum(w.scheduler.local for w in self.decode)
        res["prefill_cached_fraction"] = self.prefill_cached_tokens / max(1, self.prefill_prompt_tokens)
        return res


def run_pd(cost, config, prefill, decode, requests, **kw) -> dict:
    fleet = PDFleet(cost, config, prefill, decode, **kw)
    return fleet.run([replace(r) for r in requests])
