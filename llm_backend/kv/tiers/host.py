"""The host KV tier (L2) and the tier logic of the radix cache: write-back, cross-tier matching, loading.

Every tree node keeps its full-pool slots while it is on the device (`node.full`), or `None` once its device copy
was evicted; `node.host` is its host copy (`HostCopy`): host pages with the full layers' KV of all its tokens and
host SWA slots for the sliding layers' KV of the W tokens before each point where a match may end (the node end
and, with denser checkpoints, the node's last checkpoint: `SWARadixCache.window_ends`), since a sliding layer needs
exactly the W tokens before a match end. The device-resident nodes are always a top of the tree (a
node on the device has its parent on the device): device eviction takes nodes with no device child.

- Device full eviction (`evict_full`) writes a node back to the host (unless it already has a host copy: then the
  eviction is free) and keeps it in the tree; without host room its host-only subtree and itself are removed.
- `write_through`: a node gets its host copy when it is inserted, not when it is evicted.
- `swa_backfill`: before SWA eviction tombstones a node, its node-end window goes to the host, so hits ending
  there survive the tombstone (the full KV is still on the device).
- Host eviction (LRU by the tree's stamps, or FIFO by write time): drops the host copy of a node that is also on
  the device, or removes a host-only leaf. A removed node's pages go to the shared store when there is one
  (`store_write="evict"`); with `store_write="insert"` a new leaf's pages go to the store when it is inserted
  instead, so another worker can reuse a prefix while the worker that computed it still holds it (round-robin
  placement needs that: under write-on-evict a page reaches the store only once its writer has lost it).
- `match`: the window-safe rule counts an SWA token as present if it is on the device or the host; a match may
  continue into the shared store (pages whose chained hashes follow the tree's path). Every host or store part
  of the match gets fresh device slots at once (the tree owns them, as any node's) and its KV is queued for the
  runner's layerwise load (`loader.py`); when the device cannot make room the match falls back to the
  device-resident part.

Data mode (the engine) copies real tensors (`attach(pools)`); bookkeeping mode (the benchmark) moves only slots.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass

import torch

from ..events import block_hashes
from ..pools import SlotPool
from ..swa_radix_cache import Match, Node
from .loader import LayerwiseLoad, LoadPlan, LoadStats, PendingLoads
from .store import PageData

log = logging.getLogger(__name__)


class HostCopy:
    __slots__ = ("pages", "swa", "stamp")

    def __init__(self, pages: list[int] | None = None, swa: dict[int, int] | None = None, stamp: int = 0):
        self.pages = pages  # host full pages covering the node's tokens (None: not on the host)
        self.swa = swa if swa is not None else {}  # node token index -> host SWA slot (window tokens only)
        self.stamp = stamp

    @property
    def empty(self) -> bool:
        return self.pages is None and not self.swa


class HostKV:
    """Host tensors: per full layer [full_slots, Hkv, D] (+ V), per sliding layer [swa_slots, Hkv, D] (+ V). Pinned
    on CUDA so host->device copies are asynchronous."""

    def __init__(self, like, full_slots: int, swa_slots: int):
        dev = next(iter(like.k.values())).device
        pin = dev.type == "cuda"
        self.k, self.v = {}, {}
        for layer, t in like.k.items():
            n = swa_slots if like.sliding[layer] else full_slots
            self.k[layer] = torch.zeros((max(n, 1), *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            self.v[layer] = torch.zeros((max(n, 1), *like.v[layer].shape[1:]), dtype=t.dtype, pin_memory=pin)
        self.sliding = like.sliding


def token_bytes(pools) -> tuple[int, int]:
    """KV bytes per token of the full layers and of the sliding layers of `pools` (a KVPools)."""
    full = swa = 0
    for layer, k in pools.k.items():
        b = (k[0].numel() + pools.v[layer][0].numel()) * k.element_size()
        if pools.sliding[layer]:
            swa += b
        else:
            full += b
    return full, swa


@dataclass
class TierStats:
    hit_device: int = 0  # matched tokens already on the device
    hit_host: int = 0  # matched tokens loaded from the host
    hit_store: int = 0  # matched tokens loaded from the shared store
    pages_d2h: int = 0  # full pages written back device -> host
    pages_h2d: int = 0  # full pages loaded host -> device
    pages_s2d: int = 0  # full pages loaded store -> device
    pages_to_store: int = 0  # pages handed to the store
    swa_d2h: int = 0  # SWA tokens written to the host (write-back, back-fill)
    swa_h2d: int = 0
    swa_s2d: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    bytes_s2d: int = 0
    host_evictions: int = 0  # host copies dropped or host-only nodes removed
    backfills: int = 0
    fallbacks: int = 0  # matches cut to the device part: the device could not make room for the load


class KVTiers:
    def __init__(
        self,
        cache,
        host_full_tokens: int,
        host_swa_tokens: int,
        *,
        policy: str = "lru",
        write_through: bool = False,
        swa_backfill: bool = False,
        store=None,
        store_write: str = "evict",
        max_store_pages: int = 256,
        token_bytes: tuple[int, int] = (0, 0),
        evict_fraction: float = 1 / 64,
    ):
        if policy not in ("lru", "fifo"):
            raise ValueError(f"host KV eviction policy must be lru or fifo, got {policy!r}")
        if store_write not in ("evict", "insert"):
            raise ValueError(f"KV store writes must be evict or insert, got {store_write!r}")
        self.cache = cache
        self.P, self.W = cache.page_size, cache.window
        self.full = SlotPool("host-full", host_full_tokens, self.P) if host_full_tokens > 0 else None
        self.swa = SlotPool("host-swa", host_swa_tokens) if host_full_tokens > 0 and host_swa_tokens > 0 else None
        self.policy, self.write_through, self.swa_backfill = policy, write_through, swa_backfill
        self.store, self.max_store_pages, self.store_write = store, max_store_pages, store_write
        self.full_b, self.swa_b = token_bytes
        self.min_full = max(1, int((self.full.pages if self.full else 0) * evict_fraction))
        self.min_swa = max(1, int((self.swa.size if self.swa else 0) * evict_fraction))
        self.stats = TierStats()
        self.load_stats = LoadStats()
        self.pending = PendingLoads()
        self.device = None  # KVPools (data mode)
        self.data: HostKV | None = None
        self._clock = itertools.count(1)
        cache.tiers = self

    # ----------------------------------------------------------------------------------- data mode
    def attach(self, pools) -> None:
        """Data mode: `pools` are the device KV tensors; host tensors are allocated to match."""
        self.device = pools
        self.full_b, self.swa_b = token_bytes(pools)
        self.data = HostKV(pools, self.full.size if self.full else 0, self.swa.size if self.swa else 0)
        if self.store is not None and hasattr(self.store, "expect"):
            expect = {}
            for layer, k in pools.k.items():
                part = "swa" if pools.sliding[layer] else "full"
                n = self.W if part == "swa" else self.P
                expect[(part, layer)] = ([n, *k.shape[1:]], [n, *pools.v[layer].shape[1:]])
            self.store.expect, self.store.dtype = expect, next(iter(pools.k.values())).dtype

    def start_load(self) -> LayerwiseLoad | None:
        """The runner's hook: the queued copies of this forward, started layer by layer."""
        if not self.pending or self.device is None:
            self.pending.take()
            return None
        return LayerwiseLoad(LoadPlan(self.pending.take(), self.device, self.data), self.load_stats)

    def flush(self) -> None:
        """Runs queued copies now: before a tier reads device slots or frees host slots a copy may still use."""
        if not self.pending:
            return
        plan = self.pending.take()
        if self.device is not None:
            LoadPlan(plan, self.device, self.data).apply_all()
            self.load_stats.flushes += 1

    def _copy(self, src: dict, src_idx: list[int], dst: dict, dst_idx: list[int], sliding: bool) -> int:
        """Copies the given layers' KV rows (device <-> host); returns bytes moved."""
        if self.device is None or not src_idx:
            return 0
        moved = 0
        for layer in self.device.k:
            if self.device.sliding[layer] != sliding:
                continue
            for s, d in ((src[0], dst[0]), (src[1], dst[1])):
                rows = s[layer][torch.tensor(src_idx, device=s[layer].device)]
                d[layer][torch.tensor(dst_idx, device=d[layer].device)] = rows.to(d[layer].device)
                moved += rows.numel() * rows.element_size()
        return moved

    def _d2h(self, dev_idx, host_idx, sliding) -> int:
        return (
            self._copy((self.device.k, self.device.v), dev_idx, (self.data.k, self.data.v), host_idx, sliding)
            if self.device is not None
            else len(dev_idx) * (self.swa_b if sliding else self.full_b)
        )

    # ----------------------------------------------------------------------------------- helpers
    def _slots(self, pages: list[int]) -> list[int]:
        return [p * self.P + o for p in pages for o in range(self.P)]

    def _chain(self, node: Node) -> list[Node]:
        out = []
        while node is not None and node is not self.cache.root:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def _stamp(self, node: Node) -> int:
        return node.last_access if self.policy == "lru" else node.host.stamp

    def split(self, head: Node, tail: Node, at: int) -> None:
        """`_split` moved tail's first `at` tokens into head: their host copy goes with them."""
        h = tail.host
        if h is None:
            return
        hp = HostCopy(
            h.pages[: at // self.P] if h.pages is not None else None,
            {j: s for j, s in h.swa.items() if j < at},
            h.stamp,
        )
        if h.pages is not None:
            h.pages = h.pages[at // self.P :]
        h.swa = {j - at: s for j, s in h.swa.items() if j >= at}
        head.host = None if hp.empty else hp
        if h.empty:
            tail.host = None

    # ----------------------------------------------------------------------------------- host room
    def _make_host_room(self, pages: int, swa: int, exclude: Node | None = None) -> bool:
        if self.full is None or (swa and self.swa is None):
            return False
        if len(self.full._free) >= pages and (not swa or self.swa.available() >= swa):
            return True
        want_p = max(pages, len(self.full._free) + self.min_full) if len(self.full._free) < pages else 0
        want_s = max(swa, self.swa.available() + self.min_swa) if swa and self.swa.available() < swa else 0

        def victim(n: Node) -> bool:
            return (
                n.host is not None and n is not exclude and n.full_locks == 0 and (n.full is not None or not n.children)
            )

        nodes = list(self.cache._nodes())
        heap = [(self._stamp(n), k, n) for k, n in enumerate(nodes) if victim(n)]
        heapq.heapify(heap)
        # Re-queued parents rank after every node: a rank already in the heap with the same stamp would make heapq
        # compare the two nodes themselves (a TypeError).
        ranks = itertools.count(len(nodes))
        while heap and (len(self.full._free) < want_p or (want_s and self.swa.available() < want_s)):
            _, _, n = heapq.heappop(heap)
            if not victim(n) or n.parent is None:
                continue
            self.stats.host_evictions += 1
            h = n.host
            if self.pending.touches(False, host=self._slots(h.pages or [])) or self.pending.touches(
                True, host=h.swa.values()
            ):
                self.flush()  # a queued copy still reads a host slot freed here
            if n.full is not None:  # also on the device: dropping the host copy loses nothing
                self._free_host(n)
                continue
            parent = n.parent
            self.cache._remove_leaf(n)  # host-only leaf: gone from the tree (to the store, if any)
            if parent is not self.cache.root and victim(parent):
                heapq.heappush(heap, (self._stamp(parent), next(ranks), parent))
        return len(self.full._free) >= pages and (not swa or self.swa.available() >= swa)

    def _free_host(self, node: Node) -> None:
        h = node.host
        if h is None:
            return
        if h.pages is not None:
            self.full.free_pages(h.pages)
        if h.swa:
            self.swa.free(list(h.swa.values()))
        node.host = None

    # ----------------------------------------------------------------------------------- write paths
    def _window_js(self, node: Node) -> list[int]:
        """Window tokens (before the node end and its checkpoint, `window_ends`) live on the device and not yet on
        the host."""
        hs = node.host.swa if node.host is not None else {}
        return sorted(j for j in self.cache.window_tokens(node) if node.swa[j] is not None and j not in hs)

    def _write_host(self, node: Node, full: bool, js: list[int]) -> bool:
        """Copies the node's full KV (if `full`) and the SWA of tokens `js` to the host."""
        need = len(node.key) // self.P if full else 0
        if not self._make_host_room(need, len(js), exclude=node):
            return False
        if self.pending.touches(False, device=node.full if full else ()) or self.pending.touches(
            True, device=[node.swa[j] for j in js]
        ):
            self.flush()  # device slots read below are still waiting for a queued load
        h = node.host or HostCopy()
        node.host = h
        h.stamp = next(self._clock)
        if full:
            h.pages = self.full.alloc_pages(need)
            self.stats.bytes_d2h += self._d2h(node.full, self._slots(h.pages), False)
            self.stats.pages_d2h += need
        if js:
            hs = self.swa.alloc(len(js))
            self.stats.bytes_d2h += self._d2h([node.swa[j] for j in js], hs, True)
            h.swa.update(zip(js, hs))
            self.stats.swa_d2h += len(js)
        return True

    def on_insert(self, leaf: Node) -> None:
        """Write-through: a new leaf is copied to the host at once; with `store_write="insert"`, to the store."""
        if self.write_through and self.full is not None:
            self._write_host(leaf, True, self._window_js(leaf)) or self._write_host(leaf, True, [])
        if self.store_write == "insert" and self.store is not None and self.store.up:
            self._sink(leaf)

    def backfill(self, node: Node) -> None:
        """SWA eviction is about to tombstone `node`: its node-end window goes to the host first."""
        if not self.swa_backfill or self.swa is None:
            return
        js = self._window_js(node)
        if js and self._write_host(node, False, js):
            self.stats.backfills += 1

    def _write_back(self, node: Node) -> bool:
        """Device full eviction of `node`: keep it as a host-only node if the host can take it."""
        if self.full is None:
            return False
        h = node.host
        js = self._window_js(node)
        if h is None or h.pages is None:
            if not (self._write_host(node, True, js) or self._write_host(node, True, [])):
                return False
        elif js:
            self._write_host(node, False, js)  # best effort: the full copy is there already
        c = self.cache
        c.full_pool.free(node.full)
        c.swa_pool.free([s for s in node.swa if s is not None])
        node.full, node.swa = None, [None] * len(node.key)
        return True

    def on_remove(self, node: Node) -> None:
        """`node` leaves the tree: its pages go to the store (if any, and written on eviction), its host copy is
        freed."""
        if self.store_write == "evict" and self.store is not None and self.store.up:
            self._sink(node)
        self._free_host(node)

    def _sink(self, node: Node) -> None:
        chain = self._chain(node)
        tokens = [t for n in chain for t in n.key]
        start = len(tokens) - len(node.key)
        hashes = block_hashes(tokens, self.P)
        h = node.host
        npages = len(node.key) // self.P
        W = self.W

        def live(j: int) -> bool:
            return node.swa[j] is not None or (h is not None and j in h.swa)

        # A page ending where a match may end (`window_ends`) carries the window before it, when all of it is live.
        windows = {
            e: list(range(e - W, e))
            for e in self.cache.window_ends(node)
            if e >= W and e % self.P == 0 and all(live(j) for j in range(e - W, e))
        }
        if self.device is not None and (
            self.pending.touches(False, device=node.full or ())
            or self.pending.touches(True, device=[s for s in node.swa if s is not None])
        ):
            self.flush()
        for i in range(npages):
            win_js = windows.get((i + 1) * self.P)
            page = PageData(
                hashes[start // self.P + i],
                has_window=win_js is not None,
                nbytes=self.P * self.full_b + (W * self.swa_b if win_js is not None else 0),
            )
            if self.device is not None:
                if node.full is not None:
                    src, idx = (self.device.k, self.device.v), node.full[i * self.P : (i + 1) * self.P]
                else:
                    src, idx = (self.data.k, self.data.v), self._slots(h.pages[i : i + 1])
                self._gather(page.full, src, idx, False)
                if win_js is not None:
                    for layer in self.device.k:
                        if not self.device.sliding[layer]:
                            continue
                        ks, vs = [], []
                        for j in win_js:
                            if node.swa[j] is not None:
                                ks.append(self.device.k[layer][node.swa[j]].cpu())
                                vs.append(self.device.v[layer][node.swa[j]].cpu())
                            else:
                                ks.append(self.data.k[layer][h.swa[j]])
                                vs.append(self.data.v[layer][h.swa[j]])
                        page.swa[layer] = (torch.stack(ks), torch.stack(vs))
            self.store.put(page)
            self.stats.pages_to_store += 1

    def _gather(self, out: dict, src, idx: list[int], sliding: bool) -> None:
        for layer in self.device.k:
            if self.device.sliding[layer] == sliding:
                t = torch.tensor(idx, device=src[0][layer].device)
                out[layer] = (src[0][layer][t].cpu(), src[1][layer][t].cpu())

    # ----------------------------------------------------------------------------------- device eviction
    def evict_full(self, num: int) -> int:
        """The radix cache's `evict_full` with a host tier: LRU over unlocked device nodes with no device child."""
        c = self.cache

        def cand(n: Node) -> bool:
            return n.full is not None and n.full_locks == 0 and all(ch.full is None for ch in n.children.values())

        heap, rank = c._lru_heap(cand)
        freed = 0
        while heap and freed < num:
            _, _, node = heapq.heappop(heap)
            if not cand(node) or node.parent is None or node.parent.children.get(c._edge(node.key)) is not node:
                continue
            parent = node.parent
            n = len(node.full)
            if self._write_back(node):
                freed += n
                if not node.children and not node.host.swa:
                    c._remove_leaf(node)  # a host-only leaf no match can end in: useless
            else:
                for child in list(node.children.values()):
                    self._drop_subtree(child)
                freed += c._remove_leaf(node)
            if parent is not c.root and cand(parent):
                if (
                    not parent.children
                    and parent.tombstone
                    and parent.swa_locks == 0
                    and (parent.host is None or not parent.host.swa)
                ):
                    freed += c._prune_tombstone_leaves(parent)
                else:
                    heapq.heappush(heap, (parent.last_access, rank[parent.id], parent))
        c.stats.full_evicted += freed
        return freed

    def _drop_subtree(self, node: Node) -> None:
        """Removes a host-only subtree (its device parent is being removed without a host copy)."""
        for child in list(node.children.values()):
            self._drop_subtree(child)
        self.cache._remove_leaf(node)

    # ----------------------------------------------------------------------------------- matching
    def _avail(self, path: list[Node]) -> list:
        out = []
        for node in path:
            hs = node.host.swa if node.host is not None else None
            out.extend(True if s is not None or (hs and j in hs) else None for j, s in enumerate(node.swa))
        return out

    def peek(self, tokens: list[int]) -> int:
        """Read-only window-safe length across the device and the host (the store is not asked)."""
        c = self.cache
        avail: list = []
        i = 0
        for child, k in c._match(list(tokens)):
            avail.extend(self._avail([child])[:k])
            i += k
        return c._window_safe(avail, i)

    def _store_lookup(self, tokens: list[int], m: int) -> list[PageData]:
        P, W = self.P, self.W
        whole = len(tokens) - len(tokens) % P
        if whole <= m:
            return []
        hashes = block_hashes(tokens[:whole], P)
        first = m // P
        pages = self.store.get_many(hashes[first : first + self.max_store_pages])
        run = []
        for p in pages:
            if p is None:
                break
            run.append(p)
        best = 0
        for i, p in enumerate(run):
            end = (first + i + 1) * P
            if p.has_window and end - W >= m:
                best = i + 1
        return run[:best]

    def _device_match(self, tokens: list[int]) -> Match:
        """The match without loading anything: the device-resident part only."""
        c = self.cache
        path, _ = c._walk(tokens)
        dev = []
        for node in path:
            if node.full is None:
                break
            dev.append(node)
        m = sum(len(n.key) for n in dev)
        n = c._window_safe([s for x in dev for s in x.swa], m)
        node = c._node_ending_at(dev, n) if n else c.root
        return self._finish(node, n, m, 0, 0)

    def _finish(self, node: Node, n: int, raw: int, host_tokens: int, store_tokens: int) -> Match:
        c = self.cache
        stamp = next(c._clock)
        chain = self._chain(node)
        for x in chain:
            x.last_access = stamp
        c.stats.hit_tokens += n
        c.stats.raw_hit_tokens += raw
        self.stats.hit_host += host_tokens
        self.stats.hit_store += store_tokens
        self.stats.hit_device += n - host_tokens - store_tokens
        return Match(n, [s for x in chain for s in x.full], [s for x in chain for s in x.swa], node, raw)

    def match(self, tokens: list[int]) -> Match:
        c, P, W = self.cache, self.P, self.W
        c.stats.lookups += 1
        tokens = list(tokens)
        path, m = c._walk(tokens)
        n = c._window_safe(self._avail(path), m)
        store_pages = self._store_lookup(tokens, m) if self.store is not None and self.store.up else []
        end_store = m + len(store_pages) * P
        if end_store <= n:
            store_pages = []
        tree_end = m if store_pages else n
        node = c._node_ending_at(path, tree_end) if tree_end else c.root
        chain = self._chain(node)
        c.lock(node)  # the path is protected while device room is made
        fill = []  # (node, j): window tokens only on the host
        if not store_pages:
            left = W
            for x in reversed(chain):
                for j in range(len(x.key) - 1, -1, -1):
                    if left <= 0:
                        break
                    if x.swa[j] is None:
                        fill.append((x, j))
                    left -= 1
                if left <= 0:
                    break
        win = min(W, end_store) if store_pages else 0
        need_full = sum(len(x.key) for x in chain if x.full is None) + len(store_pages) * P
        if need_full or fill or win:
            if not c.make_room(need_full, len(fill) + win):
                c.unlock(node)
                self.stats.fallbacks += 1
                return self._device_match(tokens)
        host_tokens = 0
        for x in chain:
            if x.full is None:
                pages = c.full_pool.alloc_pages(len(x.key) // P)
                x.full = self._slots(pages)
                self.pending.add_host(False, self._slots(x.host.pages), x.full)
                host_tokens += len(x.key)
                self.stats.pages_h2d += len(pages)
                self.stats.bytes_h2d += len(x.key) * self.full_b
        for x, j in fill:
            s = c.swa_pool.alloc(1)[0]
            x.swa[j] = s
            self.pending.add_host(True, [x.host.swa[j]], [s])
            self.stats.swa_h2d += 1
            self.stats.bytes_h2d += self.swa_b
        final = node
        if store_pages:
            full = self._slots(c.full_pool.alloc_pages(len(store_pages)))
            swa_slots = c.swa_pool.alloc(win)
            key = tokens[m:end_store]
            leaf = Node(key, full, [None] * (len(key) - win) + swa_slots, node)
            node.children[c._edge(key)] = leaf
            if self.device is not None:
                per = {
                    layer: (
                        torch.cat([p.full[layer][0] for p in store_pages]),
                        torch.cat([p.full[layer][1] for p in store_pages]),
                    )
                    for layer in store_pages[0].full
                }
                self.pending.add_tensors(False, full, per)
                self.pending.add_tensors(True, swa_slots, store_pages[-1].swa)
            self.stats.pages_s2d += len(store_pages)
            self.stats.swa_s2d += win
            self.stats.bytes_s2d += sum(p.nbytes for p in store_pages)
            if c.on_event is not None:
                c.on_event("stored", leaf)
            c.lock(leaf)
            c.unlock(node)
            final = leaf
        c.unlock(final)
        return self._finish(
            final, end_store if store_pages else tree_end, m, host_tokens, end_store - m if store_pages else 0
        )

    # ----------------------------------------------------------------------------------- observability
    def accounting(self) -> dict:
        held_p = held_s = 0
        for n in self.cache._nodes():
            if n.host is not None:
                held_p += len(n.host.pages) if n.host.pages is not None else 0
                held_s += len(n.host.swa)
        return {
            "host_full_pages": {
                "held": held_p,
                "free": len(self.full._free) if self.full else 0,
                "total": self.full.pages if self.full else 0,
            },
            "host_swa": {
                "held": held_s,
                "free": self.swa.available() if self.swa else 0,
                "total": self.swa.size if self.swa else 0,
            },
        }

    def metrics(self) -> dict:
        acc = self.accounting()
        out = {f"kv_tier_{k}": v for k, v in self.stats.__dict__.items()}
        out.update({f"kv_load_{k}": v for k, v in self.load_stats.as_dict().items()})
        out["kv_host_full_tokens_used"] = acc["host_full_pages"]["held"] * self.P
        out["kv_host_full_tokens_total"] = acc["host_full_pages"]["total"] * self.P
        out["kv_host_swa_used"] = acc["host_swa"]["held"]
        out["kv_host_swa_total"] = acc["host_swa"]["total"]
        if self.store is not None:
            out.update({f"kv_store_{k}": v for k, v in self.store.stats.as_dict().items()})
            out["kv_store_up"] = int(bool(self.store.up))
        return out
