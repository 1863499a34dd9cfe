"""Rank 0's handle on a split model: every call that runs collectives is first sent to the other ranks, which make
the same call on their shards (rank.py), then made here.

The calls are the model's forward entry points the runners use: `forward_batch` and `hidden_states` (the model's
layers over a `PagedBatch`), `mtp_step` (one MTP layer over a `LayerOffset` batch), `logits` (the LM head and its
gather) and `embed` (the split embedding). A batch crosses as its `SeqSlots` (and layer offset): every rank's pools
have the same slots, so each rank rebuilds the same batch over its own pools. Tensor arguments are sent as they are
(CPU tensors; the ranks move them to their device). Anything that fails here after a call was sent leaves the ranks
out of step, so it takes the replica down (`ReplicaDown`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..paged_attention import LayerOffset, PagedBatch
from .shard import Shard

# The methods sent to the other ranks, and whether their last argument is a batch over the KV pools.
CALLS = {"forward_batch": True, "hidden_states": True, "mtp_step": True, "logits": False, "embed": False}
# The host KV tier's copies, made by every rank on its own heads (`MirroredTier`; rank.py `RankTier`).
TIER_CALLS = ("tier_attach", "tier_d2h", "tier_load")
# ... and the one that answers: a rank's heads of a store page's rows (gathered by rank 0).
TIER_ROWS = "tier_rows"
# P/D's KV transfer, each rank writing its own heads (`MirroredTransfer`; rank.py `RankTransfer`); both answer.
PD_CALLS = ("pd_attach", "pd_write")
# Data-parallel attention (data.py): the replica's step is over, every rank shadows the other DP ranks' rounds.
DP_FINISH = "dp_finish"


class ModelCall(NamedTuple):
    """One call every rank makes: `method` (one of CALLS) with `args`; for a batched call `seqs` (its
    `SeqSlots`) and `base` (the layer offset of an MTP batch, or None) describe the batch."""

    method: str
    args: tuple
    seqs: list | None = None
    base: int | None = None


def describe(method: str, args: tuple) -> ModelCall:
    """The call as the other ranks receive it (the batch argument replaced by what rebuilds it)."""
    if not CALLS[method]:
        return ModelCall(method, tuple(_cpu(a) for a in args))
    *rest, paged = args
    if isinstance(paged, LayerOffset):
        return ModelCall(method, tuple(_cpu(a) for a in rest), paged.batch.seqs, paged.base)
    return ModelCall(method, tuple(_cpu(a) for a in rest), paged.seqs)


def rebuild(call: ModelCall, pools, device: torch.device) -> tuple:
    """The call's arguments on a rank: tensors on its device, the batch over its pools."""
    args = tuple(_to(a, device) for a in call.args)
    if call.seqs is None:
        return args
    paged: Any = PagedBatch(pools, call.seqs)
    if call.base is not None:
        paged = LayerOffset(paged, call.base)
    return (*args, paged)


def _cpu(a):
    if isinstance(a, torch.Tensor):
        return a.cpu()
    if isinstance(a, list):
        return [_cpu(x) for x in a]
    if isinstance(a, tuple) and hasattr(a, "_fields"):  # a SeqInput
        return type(a)(*(_cpu(x) for x in a))
    if isinstance(a, tuple):
        return tuple(_cpu(x) for x in a)
    return a


def _to(a, device: torch.device):
    if isinstance(a, torch.Tensor):
        return a.to(device)
    if isinstance(a, list):
        return [_to(x, device) for x in a]
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*(_to(x, device) for x in a))
    if isinstance(a, tuple):
        return tuple(_to(x, device) for x in a)
    return a


class MirroredModel:
    """Stands for the model on rank 0 (what a runner holds): the forward entry points are sent, then run; the
    rest (`config`, `model`, `parameters`, `par`) is the local model's."""

    def __init__(self, model, replica):
        self.local, self.replica = model, replica
        self.config, self.model, self.par = model.config, model.model, model.par

    def parameters(self):
        return self.local.parameters()

    def _call(self, method: str, *args):
        self.replica.send(describe(method, args))
        try:
            return getattr(self.local, method)(*args)
        except Exception as e:  # noqa: BLE001 - a failed collective or forward: the replica is down
            self.replica.fail(e)
            raise

    def forward_batch(self, segments, logits_for, paged):
        return self._call("forward_batch", segments, logits_for, paged)

    def hidden_states(self, segments, paged):
        return self._call("hidden_states", segments, paged)

    def mtp_step(self, layer, embeds, hidden, positions, paged):
        return self._call("mtp_step", layer, embeds, hidden, positions, paged)

    def logits(self, hidden):
        return self._call("logits", hidden)

    def embed(self, ids):
        return self._call("embed", ids)


class MirroredTier:
    """The KV tiers' `TierPeers` (kv/tiers/cache.py) on rank 0: each copy the tier makes on rank 0's pools is sent to
    the other ranks first, which make it on theirs (rank.py `RankTier`). Slots are rank 0's, as for the forwards;
    the calls share the forwards' ordered channel, so a rank's host rows are written before a forward that reads
    them and a write-back happens before the slots are reused. A failed send takes the replica down.

    The shared store keeps whole-model pages: a page rank 0 writes is every rank's heads of its rows, gathered
    (`tier_rows`) and joined by the KV-head rule (`Shard.kv_part`: a head replicated over ranks is taken once); a
    page it reads is sent whole with the loads and each rank keeps its own heads. `whole_heads`: the unsplit
    model's KV heads of each pool layer."""

    def __init__(self, replica, whole_heads: dict[int, int]):
        self.replica, self.whole_heads = replica, whole_heads
        self.size = replica.spec.size

    def attach(self, host_full_slots: int, host_swa_slots: int) -> None:
        self.replica.send(ModelCall("tier_attach", (host_full_slots, host_swa_slots)))

    def copy_d2h(self, sliding: bool, dev_idx: list[int], host_idx: list[int]) -> None:
        self.replica.send(ModelCall("tier_d2h", (sliding, dev_idx, host_idx)))

    def load(self, host: dict, tensors: list) -> None:
        if any(src for src, _ in host.values()) or tensors:
            host = {k: (list(s), list(d)) for k, (s, d) in host.items()}
            self.replica.send(ModelCall("tier_load", (host, tensors)))

    def whole_rows(self, parts: list, mine: list[dict]) -> list[dict]:
        self.replica.send(ModelCall("tier_rows", (parts,)))
        every = self.replica.gather(mine)
        return [{layer: self._join(layer, [r[j][layer] for r in every]) for layer in mine[j]} for j in range(len(mine))]

    def _join(self, layer: int, per_rank: list[tuple]) -> tuple:
        """One layer's (k, v) rows from every rank, joined along the heads in head order."""
        heads = self.whole_heads[layer]
        ks, vs, have = [], [], 0
        for r, (k, v) in enumerate(per_rank):
            if Shard(r, self.size).kv_part(heads).start == have:
                ks.append(k)
                vs.append(v)
                have += k.shape[1]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def mine(self, tensors: list) -> list:
        return [(sliding, dst, cut_heads(per, Shard(0, self.size))) for sliding, dst, per in tensors]

    def whole_shape(self, layer: int, shape: list[int]) -> list[int]:
        return [shape[0], self.whole_heads[layer], *shape[2:]]


def cut_heads(per_layer: dict, shard: Shard) -> dict:
    """A rank's KV heads of whole-model rows {layer: (k [n, heads, dim], v)} (the pools' rule, `Shard.kv_part`)."""
    out = {}
    for layer, (k, v) in per_layer.items():
        part = shard.kv_part(k.shape[1])
        out[layer] = (k[:, part], v[:, part])
    return out


class MirroredTransfer:
    """P/D's KV transfer on rank 0 of a model-parallel worker (what `KVTransferEngine` is on one rank): every rank
    runs its own Mooncake transfer engine on its own pools (rank.py `RankTransfer`), so each rank's heads go
    straight from a prefill rank to the decode rank of the same number, never through rank 0.

    `ranks` are the (session, layout) of every rank, rank 0's first (a decode worker sends them to its prefill
    worker: pd.proto `RankPools`). `write_ranks(targets, full, swa)` sends the slot pairs to the other ranks, writes
    rank 0's part, then gathers every rank's bytes or error: the call returns only when no write of any rank is in
    flight (the room's fencing holds for the whole replica), and one rank's failure fails the whole write
    (`TransferError` naming the rank). Calls come from the engine thread (writes) or before serving (start-up),
    like the forwards."""

    def __init__(self, xfer, replica, host: str, protocol: str, device: str):
        self.xfer, self.replica = xfer, replica
        self.session, self.layout = xfer.session, xfer.layout
        replica.send(ModelCall("pd_attach", (host, protocol, device)))
        got = replica.gather((xfer.session, xfer.layout, ""))
        errors = [f"rank {r}: {err}" for r, (_, _, err) in enumerate(got) if err]
        if errors:
            raise RuntimeError(f"the ranks' KV transfer engines did not start ({'; '.join(errors)})")
        self.ranks = tuple((session, layout) for session, layout, _ in got)

    def write_ranks(self, targets, full, swa) -> int:
        from ..kv.transfer import TransferError

        if len(targets) != len(self.ranks):
            raise TransferError(
                f"the peer runs at tensor-parallel size {len(targets)}, this worker at {len(self.ranks)}: each rank "
                "writes its own heads into the peer's rank of the same number, so the sizes must be equal"
            )
        self.replica.send(ModelCall("pd_write", (tuple(targets), full, swa)))
        try:
            mine: tuple[int, str] = (self.xfer.write(targets[0][0], targets[0][1], full, swa), "")
        except TransferError as e:
            mine = (0, str(e))
        got = self.replica.gather(mine)
        errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(got) if err]
        if errors:
            raise TransferError("; ".join(errors))
        return sum(n for n, _ in got)

    def close(self) -> None:
        self.xfer.close()  # the other ranks' engines end with their processes
