"""The tiered radix cache: the SWA-aware radix cache with a host tier (L2) and a shared page store (L3) below the
device pools. A subclass of `SWARadixCache` that overrides its extension points; nothing in the plain cache knows
about tiers.

Every tree node keeps its full-pool slots while it is on the device (`node.full`), or `None` once its device copy
was evicted; `node.host` is its host copy (`HostCopy`): host pages with the full layers' KV of all its tokens and
host SWA slots for the sliding layers' KV of the W tokens before each point where a match may end (the node end
and, with denser checkpoints, the node's last checkpoint: `window_ends`), since a sliding layer needs exactly the W
tokens before a match end. The device-resident nodes are always a top of the tree (a node on the device has its
parent on the device): device eviction takes nodes with no device child.

Follow a host-tier hit through it: `match_prefix` (cross-tier match: host-only nodes and host window tokens get
fresh device slots, their copies are queued) → `start_load` (the runner's forward loads them layer by layer,
loader.py) → `_full_evictable` / `_evict_full_node` (the device copy goes back to the host, `_write_back`).

- Device full eviction writes a node back to the host (unless it already has a host copy: then the eviction is
  free) and keeps it in the tree; without host room its host-only subtree and itself are removed.
- `write_through`: a node gets its host copy when it is inserted, not when it is evicted.
- `swa_backfill`: before SWA eviction tombstones a node, its node-end window goes to the host, so hits ending
  there survive the tombstone (the full KV is still on the device).
- Host eviction (LRU by the tree's stamps, or FIFO by write time): drops the host copy of a node that is also on
  the device, or removes a host-only leaf. A removed node's pages go to the shared store when there is one
  (`store_write="evict"`); with `store_write="insert"` a new leaf's pages go to the store when it is inserted
  instead, so another worker can reuse a prefix while the worker that computed it still holds it (round-robin
  placement needs that: under write-on-evict a page reaches the store only once its writer has lost it).
- Matching: the hit rule counts an SWA token as present if it is on the device or the host (`_swa_present`); a
  match may continue into the shared store (pages whose chained hashes follow the tree's path). Every host or
  store part of the match gets fresh device slots at once (the tree owns them, as any node's) and its KV is queued
  for the runner's layerwise load; when the device cannot make room the match falls back to the device-resident
  part.

Data mode (the engine) copies real tensors (`attach(pools)`); bookkeeping mode (the benchmark, the simulator)
moves only slots.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol

import torch

from ..events import block_hashes
from ..pools import SlotPool
from ..swa_radix_cache import Match, Node, SWARadixCache
from .host import HostAccounting, HostCopy, HostKV, HostUse, TierStats, copy_to_host, read_rows, token_bytes
from .loader import LayerwiseLoad, LoadPlan, LoadStats, PendingLoads
from .store import PageData

# The host tier's eviction watermark: a fraction of its pool freed at a time (LRU scans amortised).
DEFAULT_EVICT_FRACTION = 1 / 64


class TierPeers(Protocol):
    """The other ranks of a model-parallel replica (llm_backend/parallel/mirror.py `MirroredTier`). Each holds its
    own heads' KV in pools with the same slots as this rank's, so every copy the host tier makes here is made
    there too, in the same order, on the same slots: `attach` (allocate host rows), `copy_d2h` (a write-back),
    `load` (host -> device copies, and the store's pages, before the forward that reads them). The shared store
    keeps whole-model pages (the same keys and bytes at any TP size): this rank writes every rank's heads of a
    page (`whole_rows`) and loads its own heads of what it reads (`mine`), the peers theirs (`load`)."""

    def attach(self, host_full_slots: int, host_swa_slots: int) -> None: ...

    def copy_d2h(self, sliding: bool, dev_idx: list[int], host_idx: list[int]) -> None: ...

    def load(self, host: dict, tensors: list) -> None: ...

    def whole_rows(self, parts: list, mine: list[dict]) -> list[dict]:
        """The shared store's pages: for each (sliding, rows) of `parts` (`read_rows`'s), every rank's heads of
        those rows joined into the whole model's ({layer: (k, v)}; `mine` is this rank's)."""
        ...

    def mine(self, tensors: list) -> list:
        """Store loads (whole-model pages: `PendingLoads.tensors`) cut to this rank's heads."""
        ...

    def whole_shape(self, layer: int, shape: list[int]) -> list[int]:
        """A layer's KV rows' shape [n, heads, dim] with the whole model's heads (the store's page shapes)."""
        ...


class TieredRadixCache(SWARadixCache):
    def __init__(
        self,
        full_pool: SlotPool,
        swa_pool: SlotPool,
        window: int,
        page_size: int = 1,
        *,
        host_full_tokens: int = 0,
        host_swa_tokens: int = 0,
        policy: str = "lru",
        write_through: bool = False,
        swa_backfill: bool = False,
        store=None,
        store_write: str = "evict",
        max_store_pages: int = 256,
        token_bytes: tuple[int, int] = (0, 0),
        evict_fraction: float = DEFAULT_EVICT_FRACTION,
    ):
        if policy not in ("lru", "fifo"):
            raise ValueError(f"host KV eviction policy must be lru or fifo, got {policy!r}")
        if store_write not in ("evict", "insert"):
            raise ValueError(f"KV store writes must be evict or insert, got {store_write!r}")
        super().__init__(full_pool, swa_pool, window, page_size)
        self.P, self.W = page_size, window
        self.host_full = SlotPool("host-full", host_full_tokens, page_size) if host_full_tokens > 0 else None
        self.host_swa = SlotPool("host-swa", host_swa_tokens) if host_full_tokens > 0 and host_swa_tokens > 0 else None
        self.policy, self.write_through, self.swa_backfill = policy, write_through, swa_backfill
        self.store, self.max_store_pages, self.store_write = store, max_store_pages, store_write
        self.full_b, self.swa_b = token_bytes
        self.min_full = max(1, int((self.host_full.pages if self.host_full else 0) * evict_fraction))
        self.min_swa = max(1, int((self.host_swa.size if self.host_swa else 0) * evict_fraction))
        self.tier_stats = TierStats()
        self.load_stats = LoadStats()
        self.pending = PendingLoads()
        self.device = None  # KVPools (data mode)
        self.data: HostKV | None = None
        self.peers: TierPeers | None = None  # the other ranks of a model-parallel replica
        self._host_clock = itertools.count(1)

    # ----------------------------------------------------------------------------------- data mode
    def attach(self, pools, peers: TierPeers | None = None) -> None:
        """Data mode: `pools` are the device KV tensors; host tensors are allocated to match. `peers`: the other
        ranks of a model-parallel replica, which make every host-tier copy on their own heads (`TierPeers`)."""
        self.device, self.peers = pools, peers
        self.full_b, self.swa_b = token_bytes(pools)
        self.data = HostKV(
            pools, self.host_full.size if self.host_full else 0, self.host_swa.size if self.host_swa else 0
        )
        if self.store is not None:
            expect = {}
            for layer, k in pools.k.items():
                part = "swa" if pools.sliding[layer] else "full"
                n = self.W if part == "swa" else self.P
                ks, vs = [n, *k.shape[1:]], [n, *pools.v[layer].shape[1:]]
                if peers is not None:  # whole-model pages
                    ks, vs = peers.whole_shape(layer, ks), peers.whole_shape(layer, vs)
                expect[(part, layer)] = (ks, vs)
            self.store.bind(expect, next(iter(pools.k.values())).dtype)
        if peers is not None:
            peers.attach(self.host_full.size if self.host_full else 0, self.host_swa.size if self.host_swa else 0)

    def start_load(self) -> LayerwiseLoad | None:
        """The runner's hook: the queued copies of this forward, started layer by layer (the peers make theirs
        before the forward reaches them)."""
        if not self.pending or self.device is None:
            self.pending.take()
            return None
        plan = self._to_peers(self.pending.take())
        return LayerwiseLoad(LoadPlan(plan, self.device, self.data), self.load_stats)

    def _to_peers(self, plan: PendingLoads) -> PendingLoads:
        """At TP > 1: the peers' copies sent (before this rank's), and the store's pages cut to this rank's heads."""
        if self.peers is None:
            return plan
        self.peers.load(plan.host, plan.tensors)
        plan.tensors = self.peers.mine(plan.tensors)
        return plan

    def flush(self) -> None:
        """Runs queued copies now: before a tier reads device slots or frees host slots a copy may still use."""
        if not self.pending:
            return
        plan = self.pending.take()
        if self.device is not None:
            plan = self._to_peers(plan)
            LoadPlan(plan, self.device, self.data).apply_all()
            self.load_stats.flushes += 1

    def _d2h(self, dev_idx, host_idx, sliding) -> int:
        if self.device is None:
            return len(dev_idx) * (self.swa_b if sliding else self.full_b)
        if self.peers is not None and dev_idx:
            self.peers.copy_d2h(sliding, list(dev_idx), list(host_idx))
        return copy_to_host(self.device, self.data, dev_idx, host_idx, sliding)

    def _slots(self, pages: list[int]) -> list[int]:
        return [p * self.P + o for p in pages for o in range(self.P)]

    def _stamp(self, node: Node) -> int:
        return node.last_access if self.policy == "lru" else node.host.stamp

    # ----------------------------------------------------------------------------------- the cache's extension points
    def _swa_present(self, node: Node) -> list:
        """A token's SWA KV counts when it is on the device or on the host."""
        hs = node.host.swa if node.host is not None else None
        return [True if s is not None or (hs and j in hs) else None for j, s in enumerate(node.swa)]

    def _holds_window(self, node: Node) -> bool:
        return node.host is not None and bool(node.host.swa)  # a host SWA window still makes it a match end

    def _after_split(self, head: Node, tail: Node, at: int) -> None:
        """The split moved tail's first `at` tokens into head: their host copy goes with them."""
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

    def _after_leaf_added(self, leaf: Node) -> None:
        """Write-through: a new leaf is copied to the host at once; with `store_write="insert"`, to the store."""
        if self.write_through and self.host_full is not None:
            self._write_host(leaf, True, self._window_js(leaf)) or self._write_host(leaf, True, [])
        if self.store_write == "insert" and self.store is not None and self.store.up:
            self._sink(leaf)

    def _before_leaf_removed(self, node: Node) -> None:
        """`node` leaves the tree: its pages go to the store (if any, and written on eviction), its host copy is
        freed."""
        if self.store_write == "evict" and self.store is not None and self.store.up:
            self._sink(node)
        self._free_host(node)

    def _before_tombstone(self, node: Node) -> None:
        """SWA back-fill: before SWA eviction tombstones `node`, its node-end window goes to the host."""
        if not self.swa_backfill or self.host_swa is None:
            return
        js = self._window_js(node)
        if js and self._write_host(node, False, js):
            self.tier_stats.backfills += 1

    def _full_evictable(self, node: Node) -> bool:
        """Device full eviction takes unlocked device nodes with no device child (device nodes stay a top)."""
        return node.full is not None and node.full_locks == 0 and all(ch.full is None for ch in node.children.values())

    def _evict_full_node(self, node: Node) -> int:
        """Writes `node` back to the host and keeps it (removed if no match can end in it), or, without host room,
        removes it with its host-only subtree."""
        n = len(node.full or ())
        if self._write_back(node):
            if not node.children and not node.host.swa:
                self._remove_leaf(node)  # a host-only leaf no match can end in: useless
            return n
        for child in list(node.children.values()):
            self._drop_subtree(child)
        return self._remove_leaf(node)

    # ----------------------------------------------------------------------------------- host room
    def _make_host_room(self, pages: int, swa: int, exclude: Node | None = None) -> bool:
        hf, hs = self.host_full, self.host_swa
        if hf is None or (swa and hs is None):
            return False
        if hf.free_pages_count >= pages and (not swa or hs.available() >= swa):
            return True
        want_p = max(pages, hf.free_pages_count + self.min_full) if hf.free_pages_count < pages else 0
        want_s = max(swa, hs.available() + self.min_swa) if swa and hs.available() < swa else 0

        def victim(n: Node) -> bool:
            return (
                n.host is not None and n is not exclude and n.full_locks == 0 and (n.full is not None or not n.children)
            )

        nodes = list(self.nodes())
        heap = [(self._stamp(n), k, n) for k, n in enumerate(nodes) if victim(n)]
        heapq.heapify(heap)
        # Re-queued parents rank after every node: a rank already in the heap with the same stamp would make heapq
        # compare the two nodes themselves (a TypeError).
        ranks = itertools.count(len(nodes))
        while heap and (hf.free_pages_count < want_p or (want_s and hs.available() < want_s)):
            _, _, n = heapq.heappop(heap)
            if not victim(n) or n.parent is None:
                continue
            self.tier_stats.host_evictions += 1
            h = n.host
            if self.pending.touches(False, host=self._slots(h.pages or [])) or self.pending.touches(
                True, host=h.swa.values()
            ):
                self.flush()  # a queued copy still reads a host slot freed here
            if n.full is not None:  # also on the device: dropping the host copy loses nothing
                self._free_host(n)
                continue
            parent = n.parent
            self._remove_leaf(n)  # host-only leaf: gone from the tree (to the store, if any)
            if parent is not self.root and victim(parent):
                heapq.heappush(heap, (self._stamp(parent), next(ranks), parent))
        return hf.free_pages_count >= pages and (not swa or hs.available() >= swa)

    def _free_host(self, node: Node) -> None:
        h = node.host
        if h is None:
            return
        if h.pages is not None:
            self.host_full.free_pages(h.pages)
        if h.swa:
            self.host_swa.free(list(h.swa.values()))
        node.host = None

    # ----------------------------------------------------------------------------------- write paths
    def _window_js(self, node: Node) -> list[int]:
        """Window tokens (before the node end and its checkpoint, `window_ends`) live on the device and not yet on
        the host."""
        hs = node.host.swa if node.host is not None else {}
        return sorted(j for j in self.window_tokens(node) if node.swa[j] is not None and j not in hs)

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
        h.stamp = next(self._host_clock)
        if full:
            h.pages = self.host_full.alloc_pages(need)
            self.tier_stats.bytes_d2h += self._d2h(node.full, self._slots(h.pages), False)
            self.tier_stats.pages_d2h += need
        if js:
            hs = self.host_swa.alloc(len(js))
            self.tier_stats.bytes_d2h += self._d2h([node.swa[j] for j in js], hs, True)
            h.swa.update(zip(js, hs))
            if self.swa_pool.stale_count:  # the stale marks travel with the KV (kv/pools.py)
                self.host_swa.mark_stale(x for j, x in zip(js, hs) if self.swa_pool.is_stale(node.swa[j]))
            self.tier_stats.swa_d2h += len(js)
        return True

    def _write_back(self, node: Node) -> bool:
        """Device full eviction of `node`: keep it as a host-only node if the host can take it."""
        if self.host_full is None:
            return False
        h = node.host
        js = self._window_js(node)
        if h is None or h.pages is None:
            if not (self._write_host(node, True, js) or self._write_host(node, True, [])):
                return False
        elif js:
            self._write_host(node, False, js)  # best effort: the full copy is there already
        self.full_pool.free(node.full)
        self.swa_pool.free([s for s in node.swa if s is not None])
        node.full, node.swa = None, [None] * len(node.key)
        return True

    def _drop_subtree(self, node: Node) -> None:
        """Removes a host-only subtree (its device parent is being removed without a host copy)."""
        for child in list(node.children.values()):
            self._drop_subtree(child)
        self._remove_leaf(node)

    def _sink(self, node: Node) -> None:
        """Hands `node`'s whole pages to the shared store (with the window before a page end where a match may
        end, when all of it is live on the device or the host)."""
        chain = self.chain(node)
        tokens = [t for n in chain for t in n.key]
        start = len(tokens) - len(node.key)
        hashes = block_hashes(tokens, self.P)
        h = node.host
        npages = len(node.key) // self.P
        W = self.W

        def live(j: int) -> bool:
            return node.swa[j] is not None or (h is not None and j in h.swa)

        windows = {
            e: list(range(e - W, e))
            for e in self.window_ends(node)
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
            if win_js is not None:
                page.stale = self._window_stale(node, win_js)  # the marks travel with the window (kv/pools.py)
            if self.device is not None:
                self._page_tensors(page, node, i, win_js)
            self.store.put(page)
            self.tier_stats.pages_to_store += 1

    def _page_tensors(self, page: PageData, node: Node, i: int, win_js: list[int] | None) -> None:
        """Data mode: page i of `node` (from the device, else the host) and the window before its end; at TP > 1
        with every rank's heads (the peers' rows joined: a page is the whole model's, whatever the TP size)."""
        h = node.host
        if node.full is not None:
            full = [(False, s) for s in node.full[i * self.P : (i + 1) * self.P]]
        else:
            full = [(True, s) for s in self._slots(h.pages[i : i + 1])]
        parts = [(False, full)]
        if win_js is not None:
            parts.append(
                (True, [(False, node.swa[j]) if node.swa[j] is not None else (True, h.swa[j]) for j in win_js])
            )
        rows = [read_rows(self.device, self.data, sliding, which) for sliding, which in parts]
        if self.peers is not None:
            rows = self.peers.whole_rows(parts, rows)
        page.full = rows[0]
        if win_js is not None:
            page.swa = rows[1]

    def _window_stale(self, node: Node, win_js: list[int]) -> list[int]:
        """The window rows (indices into `win_js`) whose slots are marked stale, on the device or the host."""
        if not (self.swa_pool.stale_count or (self.host_swa is not None and self.host_swa.stale_count)):
            return []
        h = node.host
        out = []
        for i, j in enumerate(win_js):
            s = node.swa[j]
            if s is not None:
                stale = self.swa_pool.is_stale(s)
            else:
                stale = h is not None and self.host_swa is not None and self.host_swa.is_stale(h.swa[j])
            if stale:
                out.append(i)
        return out

    # ----------------------------------------------------------------------------------- matching
    def _store_lookup(self, tokens: list[int], m: int) -> list[PageData]:
        """The store's pages that continue the tree's match at `m`, up to the last one carrying its window."""
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
        path, _ = self._walk(tokens)
        dev = []
        for node in path:
            if node.full is None:
                break
            dev.append(node)
        m = sum(len(n.key) for n in dev)
        n = self._window_safe([s for x in dev for s in x.swa], m)
        node = self._node_ending_at(dev, n) if n else self.root
        return self._finish(node, n, m, 0, 0)

    def _finish(self, node: Node, n: int, raw: int, host_tokens: int, store_tokens: int) -> Match:
        stamp = next(self._clock)
        chain = self.chain(node)
        for x in chain:
            x.last_access = stamp
        self.stats.hit_tokens += n
        self.stats.raw_hit_tokens += raw
        self.tier_stats.hit_host += host_tokens
        self.tier_stats.hit_store += store_tokens
        self.tier_stats.hit_device += n - host_tokens - store_tokens
        return Match(n, [s for x in chain for s in x.full], [s for x in chain for s in x.swa], node, raw)

    def _host_window_fill(self, chain: list[Node]) -> list[tuple[Node, int]]:
        """(node, j) of the last W matched tokens whose SWA KV is only on the host."""
        fill, left = [], self.W
        for x in reversed(chain):
            for j in range(len(x.key) - 1, -1, -1):
                if left <= 0:
                    break
                if x.swa[j] is None:
                    fill.append((x, j))
                left -= 1
            if left <= 0:
                break
        return fill

    def _load_host_parts(self, chain: list[Node], fill: list[tuple[Node, int]]) -> int:
        """Fresh device slots for the chain's host-only nodes and host window tokens, their copies queued; returns
        the tokens loaded from the host."""
        host_tokens = 0
        for x in chain:
            if x.full is None:
                pages = self.full_pool.alloc_pages(len(x.key) // self.P)
                x.full = self._slots(pages)
                self.pending.add_host(False, self._slots(x.host.pages), x.full)
                host_tokens += len(x.key)
                self.tier_stats.pages_h2d += len(pages)
                self.tier_stats.bytes_h2d += len(x.key) * self.full_b
        for x, j in fill:
            s = self.swa_pool.alloc(1)[0]
            x.swa[j] = s
            self.pending.add_host(True, [x.host.swa[j]], [s])
            if self.host_swa is not None and self.host_swa.is_stale(x.host.swa[j]):
                self.swa_pool.mark_stale([s])
            self.tier_stats.swa_h2d += 1
            self.tier_stats.bytes_h2d += self.swa_b
        return host_tokens

    def _add_store_leaf(self, node: Node, key: list[int], pages: list[PageData], win: int) -> Node:
        """A new leaf under `node` for the store's `pages` (device slots allocated, copies queued)."""
        full = self._slots(self.full_pool.alloc_pages(len(pages)))
        swa_slots = self.swa_pool.alloc(win)
        leaf = Node(key, full, [None] * (len(key) - win) + swa_slots, node)
        node.children[self._edge(key)] = leaf
        if self.device is not None:
            per = {
                layer: (torch.cat([p.full[layer][0] for p in pages]), torch.cat([p.full[layer][1] for p in pages]))
                for layer in pages[0].full
            }
            self.pending.add_tensors(False, full, per)
            self.pending.add_tensors(True, swa_slots, pages[-1].swa)
        self.swa_pool.mark_stale(swa_slots[i] for i in pages[-1].stale if i < len(swa_slots))
        self.tier_stats.pages_s2d += len(pages)
        self.tier_stats.swa_s2d += win
        self.tier_stats.bytes_s2d += sum(p.nbytes for p in pages)
        if self.on_event is not None:
            self.on_event("stored", leaf)
        return leaf

    def match_prefix(self, tokens: list[int]) -> Match:
        """The window-safe match across the device, the host and the store; the host and store parts are loaded
        into fresh device slots (queued for the next forward), or the match falls back to the device part when the
        device cannot make room."""
        P, W = self.P, self.W
        self.stats.lookups += 1
        tokens = list(tokens)
        path, m = self._walk(tokens)
        present = [t for node in path for t in self._swa_present(node)]
        n = self._window_safe(present, m)
        store_pages = self._store_lookup(tokens, m) if self.store is not None and self.store.up else []
        end_store = m + len(store_pages) * P
        if end_store <= n:
            store_pages = []
        tree_end = m if store_pages else n
        node = self._node_ending_at(path, tree_end) if tree_end else self.root
        chain = self.chain(node)
        self.lock(node)  # the path is protected while device room is made
        fill = [] if store_pages else self._host_window_fill(chain)
        win = min(W, end_store) if store_pages else 0
        need_full = sum(len(x.key) for x in chain if x.full is None) + len(store_pages) * P
        if (need_full or fill or win) and not self.make_room(need_full, len(fill) + win):
            self.unlock(node)
            self.tier_stats.fallbacks += 1
            return self._device_match(tokens)
        host_tokens = self._load_host_parts(chain, fill)
        final = node
        if store_pages:
            final = self._add_store_leaf(node, tokens[m:end_store], store_pages, win)
            self.lock(final)
            self.unlock(node)
        self.unlock(final)
        return self._finish(
            final, end_store if store_pages else tree_end, m, host_tokens, end_store - m if store_pages else 0
        )

    # ----------------------------------------------------------------------------------- observability
    def host_accounting(self) -> HostAccounting:
        """Host pages and SWA slots held by tree nodes, free and in total."""
        held_p = held_s = 0
        for n in self.nodes():
            if n.host is not None:
                held_p += len(n.host.pages) if n.host.pages is not None else 0
                held_s += len(n.host.swa)
        hf, hs = self.host_full, self.host_swa
        return HostAccounting(
            HostUse(held_p, hf.free_pages_count if hf else 0, hf.pages if hf else 0),
            HostUse(held_s, hs.available() if hs else 0, hs.size if hs else 0),
        )

    def tier_metrics(self) -> dict:
        acc = self.host_accounting()
        out = {f"kv_tier_{k}": v for k, v in self.tier_stats.__dict__.items()}
        out.update({f"kv_load_{k}": v for k, v in self.load_stats.as_dict().items()})
        out["kv_host_full_tokens_used"] = acc.host_full_pages.held * self.P
        out["kv_host_full_tokens_total"] = acc.host_full_pages.total * self.P
        out["kv_host_swa_used"] = acc.host_swa.held
        out["kv_host_swa_total"] = acc.host_swa.total
        if self.store is not None:
            out.update({f"kv_store_{k}": v for k, v in self.store.stats.as_dict().items()})
            out["kv_store_up"] = int(bool(self.store.up))
        return out
