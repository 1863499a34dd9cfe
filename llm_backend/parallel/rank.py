"""Ranks 1..N-1 of a model-parallel replica: each loads its shard, builds KV pools for its heads, then runs every
forward call rank 0 sends (`mirror.ModelCall`) until told to stop (None) or a peer is gone.

A rank has no scheduler, cache or API: the slots in each call are rank 0's (every rank's pools have the same slot
count, each slot holding that rank's heads), so its KV mirrors rank 0's without any bookkeeping of its own. A rank
that fails exits: the replica's next collective fails on rank 0, which fails its requests and reports the rank
(replica.py). Its stderr is the worker's.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from typing import Any

import torch

from .comm import Parallel
from .data import moe_layers
from .mirror import CALLS, DP_FINISH, PD_CALLS, TIER_CALLS, TIER_ROWS, cut_heads, rebuild
from .replica import RankSpec, join_groups, set_threads

log = logging.getLogger(__name__)


def rank_main(spec: RankSpec, rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    import torch.distributed as dist

    from mimo_epd.common.parent import exit_with_parent

    from ..models import load_llm
    from ..paged_attention import KVPools

    exit_with_parent()  # rank 0 gone, even by SIGKILL: this rank has nobody to serve
    set_threads(spec)
    try:
        control, device_group, data = join_groups(spec, rank)
        par = Parallel(spec.shard(rank), device_group, data=data)
        dtype = getattr(torch, spec.dtype)
        dev = spec.device_of(rank)
        model = load_llm(spec.model, dev, dtype, spec.fp8_weights, spec.quantization, par=par)
        pools = KVPools(par.shard.attention_config(model.config), spec.full_slots, spec.swa_slots, dtype, dev)
        if spec.mtp_layers:  # the same layer ids as rank 0's (engine/speculative.py reserve_layers)
            mtp: Any = model.model.mtp
            pools.add_sliding_layers(mtp.kv_config(), spec.swa_slots)
        dist.monitored_barrier(control, timeout=timedelta(seconds=spec.load_timeout_s))
    except Exception:
        log.exception("rank %d could not start", rank)
        sys.exit(1)
    device = torch.device(spec.device_of(rank))
    tier: RankTier | None = None
    pd: RankTransfer | None = None
    while True:
        try:
            box: list = [None]
            dist.broadcast_object_list(box, src=spec.leader, group=control)
            call = box[0]
            if call is None:
                break
            if call.method == DP_FINISH and data is not None:
                data.finish(moe_layers(model), model.lm_head.weight)
                continue
            if call.method in TIER_CALLS:
                tier = tier or RankTier(pools, spec.shard(rank))
                getattr(tier, call.method)(*call.args)
                continue
            if call.method == TIER_ROWS:
                tier = tier or RankTier(pools, spec.shard(rank))
                answers: list = [None] * spec.size
                dist.all_gather_object(answers, tier.tier_rows(*call.args), group=control)
                continue
            if call.method in PD_CALLS:
                pd = pd or RankTransfer(pools, rank)
                dist.all_gather_object([None] * spec.size, getattr(pd, call.method)(*call.args), group=control)
                continue
            if call.method not in CALLS:
                raise RuntimeError(f"rank 0 sent an unknown call {call.method!r}")
            getattr(model, call.method)(*rebuild(call, pools, device))
        except Exception:
            log.exception("rank %d: the replica failed (rank 0 gone, a peer gone or a forward failed)", rank)
            sys.exit(1)
    dist.destroy_process_group()


class RankTier:
    """A rank's KV tiers: host rows for its own heads, written and read as rank 0's tier says, its heads of the
    shared store's pages (mirror.py `MirroredTier`). It keeps no bookkeeping: the slots are rank 0's."""

    def __init__(self, pools, shard):
        self.pools, self.shard = pools, shard
        self.host = None

    def tier_attach(self, host_full_slots: int, host_swa_slots: int) -> None:
        from ..kv.tiers.host import HostKV

        self.host = HostKV(self.pools, host_full_slots, host_swa_slots)

    def tier_d2h(self, sliding: bool, dev_idx: list[int], host_idx: list[int]) -> None:
        from ..kv.tiers.host import copy_to_host

        copy_to_host(self.pools, self._host(), dev_idx, host_idx, sliding)

    def tier_load(self, host: dict, tensors: list) -> None:
        """Host -> device copies, and the shared store's whole-model pages cut to this rank's heads."""
        from ..kv.tiers.loader import LoadPlan, PendingLoads

        mine = [(sliding, dst, cut_heads(per, self.shard)) for sliding, dst, per in tensors]
        LoadPlan(PendingLoads(host=host, tensors=mine), self.pools, self.host).apply_all()

    def tier_rows(self, parts: list) -> list[dict]:
        """This rank's heads of a store page's rows (kv/tiers/host.py `read_rows`), for rank 0 to join."""
        from ..kv.tiers.host import read_rows

        return [read_rows(self.pools, self.host, sliding, rows) for sliding, rows in parts]

    def _host(self):
        if self.host is None:
            raise RuntimeError("rank 0 sent a host KV copy before the host tier was attached")
        return self.host


class RankTransfer:
    """A rank's side of P/D's KV transfer (mirror.py `MirroredTransfer`): its own Mooncake engine on its own pools.
    Each call returns its answer for rank 0's gather; a failure is answered, never raised (the gather must
    happen on every rank, and one failed write is the room's failure, not the replica's)."""

    def __init__(self, pools, rank: int):
        self.pools, self.rank = pools, rank
        self.xfer: Any = None  # its KVTransferEngine once attached

    def pd_attach(self, host: str, protocol: str, device: str) -> tuple:
        from ..kv.transfer import KVTransferEngine

        try:
            xfer = self.xfer = KVTransferEngine(self.pools, host, protocol, device)
            return xfer.session, xfer.layout, ""
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which refuses to start the role
            return "", None, str(e)

    def pd_write(self, targets, full, swa) -> tuple[int, str]:
        from ..kv.transfer import TransferError

        if self.xfer is None:
            return 0, "no transfer engine on this rank"
        session, peer = targets[self.rank]
        try:
            return self.xfer.write(session, peer, full, swa), ""
        except (TransferError, ValueError) as e:
            return 0, str(e)
