"""Ranks 1..N-1 of a model-parallel replica: each loads its shard, builds KV pools for its heads, then runs every
forward rank 0 sends (`replica.StepCall`) until told to stop (None) or a peer is gone.

A rank has no scheduler, cache or API: the slots in each call are rank 0's (every rank's pools have the same slot
count, each slot holding that rank's heads), so its KV mirrors rank 0's without any bookkeeping of its own. A rank
that fails exits: the replica's next collective fails on rank 0, which fails its requests and reports the rank
(replica.py). Its stderr is the worker's.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta

import torch

from .comm import Parallel
from .replica import RankSpec, join_groups, set_threads

log = logging.getLogger(__name__)


def rank_main(spec: RankSpec, rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    import torch.distributed as dist

    from mimo_epd.common.parent import exit_with_parent

    from ..models import load_llm
    from ..paged_attention import KVPools, PagedBatch

    exit_with_parent()  # rank 0 gone, even by SIGKILL: this rank has nobody to serve
    set_threads(spec)
    try:
        control = join_groups(spec, rank)
        par = Parallel(spec.shard(rank))
        dtype = getattr(torch, spec.dtype)
        model = load_llm(spec.model, spec.device, dtype, spec.fp8_weights, spec.quantization, par=par)
        pools = KVPools(par.shard.attention_config(model.config), spec.full_slots, spec.swa_slots, dtype, spec.device)
        dist.monitored_barrier(control, timeout=timedelta(seconds=spec.load_timeout_s))
    except Exception:
        log.exception("rank %d could not start", rank)
        sys.exit(1)
    device = torch.device(spec.device)
    while True:
        try:
            box: list = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            call = box[0]
            if call is None:
                break
            inputs = [_to(seg, device) for seg in call.inputs]
            model.forward_batch(inputs, call.modes, PagedBatch(pools, call.seqs))
        except Exception:
            log.exception("rank %d: the replica failed (rank 0 gone, a peer gone or a forward failed)", rank)
            sys.exit(1)
    dist.destroy_process_group()


def _to(seg, device: torch.device):
    """A `SeqInput` with its tensors on this rank's device."""
    media = tuple(_move(t, device) for t in seg.media) if seg.media is not None else None
    return type(seg)(
        _move(seg.input_ids, device), _move(seg.positions, device), _move(seg.inputs_embeds, device), media
    )


def _move(t, device: torch.device):
    return t.to(device) if isinstance(t, torch.Tensor) else t
