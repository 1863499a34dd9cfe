"""SWA-aware radix prefix cache (semantics in docs/caches.md).

A radix tree over token ids. Each node holds, per token, a full-pool slot (always) and an SWA-pool slot
or None (released: the token left every window that could still see it). A node whose SWA slots are
all None is a *tombstone*: its full KV still serves full-attention layers and leads to deeper nodes.

Hit rule (window-safe length): a cached prefix of length n is reusable only if its tokens match and the
SWA slots of the W tokens before n are all live (all of them when n < W) — that is exactly what a
sliding layer needs to compute token n. `match_prefix` returns the longest such n (rounded down to the
page size); everything after is recomputed.

Ownership: slots in the tree belong to the tree; a running request owns the slots of the tokens it
computed itself until it inserts them (duplicates are freed at insert; an insert whose SWA slot is live
where the tree's is None *repairs* the tree node). Locks: a running request locks the full KV of its
whole matched path, and the SWA KV only of the nodes covering its last W matched tokens.

Pages: with a paged full pool (page size P) children are keyed by their first page, nodes start and end
on page boundaries, and only whole pages are inserted; matches are rounded down to whole pages.

Eviction: the two pools are evicted separately, least recently used first. Evicting SWA tombstones a
node (its full KV stays); evicting full KV removes a leaf. A tombstone that is (or becomes) a leaf is
removed, since no window-safe match can end in it (an insert never creates one). Locked KV is never evicted.

Extension points: a subclass (the KV tiers below the device pools, kv/tiers/cache.py) changes what "present"
means and what eviction does by overriding a few methods, never by hooks in this class's code paths:
`_swa_present` (which tokens' SWA KV counts for the hit rule), `_holds_window` (a node that must stay even as a
tombstone leaf), `_after_split`, `_after_leaf_added`, `_before_leaf_removed`, `_before_tombstone`, and the pair
`_full_evictable` / `_evict_full_node` that `evict_full` runs its one LRU loop over. `match_prefix` itself may be
overridden (a tiered match loads KV from below); `peek_prefix_length` never needs to be.

LRU order: a lookup or an insert stamps every node of the path it used with one stamp, and a split gives the
head its node's stamp, so a child is never older than its parent; among equal stamps the parent goes first
(ties are broken by a pre-order walk of the tree). So SWA eviction tombstones an ancestor (keeping its full
KV as a path) before the leaf under it, never a leaf (which would lose its full KV too) before its parent.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .pools import SlotPool


def window_safe_length(present: Sequence[Any], m: int, window: int, page: int = 1) -> int:
    """The hit rule, written once: the longest n <= m (a multiple of `page`) such that every token of
    [max(0, n - window), n) is present (`present[p] is not None`; a prefix shorter than the window needs all its
    tokens). `present` holds SWA slots, or True / None for a tier's view."""
    best, last_none = 0, -1
    for p in range(m):
        if present[p] is None:
            last_none = p
        n = p + 1
        if last_none < max(0, n - window):
            best = n
    return best - best % page


def window_safe_end(present: Sequence[Any], end: int, window: int) -> bool:
    """Whether a match may end at token `end` (the hit rule for one end point)."""
    return all(s is not None for s in present[max(0, end - window) : end])


class Node:
    __slots__ = ("key", "full", "swa", "children", "parent", "full_locks", "swa_need", "last_access", "id", "host")
    _ids = itertools.count()

    def __init__(self, key: list[int], full: list[int] | None, swa: list[int | None], parent: "Node | None"):
        self.key, self.swa = key, swa
        # Full-pool slots of the node's tokens while its KV is on the device; None when only a lower tier holds it
        # (the tiered cache's host-only nodes). The plain cache never makes such nodes.
        self.full: list[int] | None = full
        self.children: dict[tuple, Node] = {}
        self.parent = parent
        self.full_locks = 0
        # SWA locks on this node, keyed by how many window tokens the lock still needed when it reached this
        # node: a split must know which locks reach back into the new head (see `_split`).
        self.swa_need: dict[int, int] = {}
        self.last_access = 0
        self.id = next(Node._ids)
        # The tiered cache's host copy (kv.tiers.host.HostCopy), or None: always None in the plain cache.
        self.host: Any = None

    @property
    def swa_locks(self) -> int:
        return sum(self.swa_need.values())

    @property
    def live_swa(self) -> int:
        return sum(s is not None for s in self.swa)

    @property
    def tombstone(self) -> bool:
        return self.live_swa == 0


@dataclass
class Match:
    length: int  # window-safe reusable tokens
    full: list[int]  # full slots of tokens [0, length)
    swa: list[int | None]  # SWA slots of tokens [0, length) (live over the last W)
    node: Node  # the tree node whose span ends at `length` (lock handle)
    raw_length: int = 0  # tokens that matched before the window-safe cut


@dataclass
class HeldSlots:
    """Slots of one pool the tree holds: evictable now, or protected by a running request's lock."""

    evictable: int = 0
    protected: int = 0


@dataclass
class CacheAccounting:
    full: HeldSlots
    swa: HeldSlots


@dataclass
class CacheStats:
    lookups: int = 0
    hit_tokens: int = 0
    raw_hit_tokens: int = 0
    swa_evicted: int = 0
    full_evicted: int = 0
    repairs: int = 0
    extra: dict = field(default_factory=dict)


def fit_checkpoint_interval(k: int, window: int, page: int) -> int:
    """The smallest multiple of `page` that is at least `k` and above `window` (what the cache accepts for a
    checkpoint interval of about k tokens); 0 stays 0 (off)."""
    if k <= 0:
        return 0
    return -(-max(k, window + 1) // page) * page


class SWARadixCache:
    def __init__(self, full_pool: SlotPool, swa_pool: SlotPool, window: int, page_size: int = 1):
        if window < 0 or page_size < 1:
            raise ValueError("window must be >= 0 and page_size >= 1")
        self.full_pool, self.swa_pool = full_pool, swa_pool
        self.window, self.page_size = window, page_size
        self.root = Node([], [], [], None)
        self.root.full_locks = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self.stats = CacheStats()
        # Optional observer `on_event(kind, node)` (llm_backend.kv.events): "stored" after a leaf is added,
        # "removed" before a leaf is dropped, "swa" after a node's SWA slots were released or repaired.
        self.on_event = None
        self._checkpoint = 0

    @property
    def swa_checkpoint_interval(self) -> int:
        """Denser SWA checkpoints (0 = off): trimming also keeps the W tokens before the last multiple of this many
        tokens inside each node. A next turn that re-sends a prompt but diverges shortly before its end (a
        re-rendered last message; on a block-hashed trace, the partial last block) then resumes there instead of
        at the previous node end. One extra window per node, not one per K tokens: keeping every multiple of 512
        cost so many SWA slots that the trace's hit tokens fell to 0.7x (docs/kv-tiers.md)."""
        return self._checkpoint

    @swa_checkpoint_interval.setter
    def swa_checkpoint_interval(self, k: int) -> None:
        if k < 0 or (k and (k <= self.window or k % self.page_size)):
            raise ValueError(
                f"SWA checkpoint interval {k} must be 0 (off) or a multiple of the page size ({self.page_size}) "
                f"larger than the window ({self.window})"
            )
        self._checkpoint = k

    # ----------------------------------------------------------------------------------- structure
    def _split(self, node: Node, at: int) -> Node:
        """Splits `node` so that its first `at` tokens become a new parent; returns that parent."""
        parent = node.parent
        assert parent is not None, "the root is never split"
        head = Node(node.key[:at], node.full[:at] if node.full is not None else None, node.swa[:at], parent)
        head.full_locks, head.last_access = node.full_locks, node.last_access  # every path through node passes head
        # An SWA lock that needed r tokens at `node` now gets len(tail) of them from the tail and reaches the head
        # only if r exceeds that; copying the count would leave locks on the head that no unlock ever reaches.
        tail_len = len(node.key) - at
        for need, count in node.swa_need.items():
            if need > tail_len:
                head.swa_need[need - tail_len] = head.swa_need.get(need - tail_len, 0) + count
        parent.children[self._edge(node.key)] = head
        node.key, node.full, node.swa = node.key[at:], node.full[at:] if node.full is not None else None, node.swa[at:]
        node.parent = head
        head.children[self._edge(node.key)] = node
        self._after_split(head, node, at)
        return head

    def _edge(self, key) -> tuple:
        """Children are keyed by their first page: two children never share a first page."""
        return tuple(key[: self.page_size])

    def _match(self, tokens: list[int]):
        """Read-only: (node, k) for each node `tokens` follows from the root, k its matched tokens (whole pages);
        the last one may match only part of its node."""
        node, i = self.root, 0
        P = self.page_size
        while i + P <= len(tokens):
            child = node.children.get(tuple(tokens[i : i + P]))
            if child is None:
                return
            k = 0
            limit = min(len(child.key), len(tokens) - i)
            while k < limit and child.key[k] == tokens[i + k]:
                k += 1
            k -= k % P  # nodes start and end on page boundaries
            partial = k < len(child.key)  # decided before yielding: the caller may split `child` meanwhile
            yield child, k
            if partial:
                return
            i += k
            node = child

    def _walk(self, tokens: list[int]) -> tuple[list[Node], int]:
        """Follows `tokens` from the root, splitting a node where the match ends inside it."""
        path, i = [], 0
        for child, k in self._match(tokens):
            if k < len(child.key):
                child = self._split(child, k)
            path.append(child)
            i += k
        return path, i

    def _window_safe(self, present: Sequence[Any], m: int) -> int:
        return window_safe_length(present, m, self.window, self.page_size)

    def chain(self, node: Node) -> list[Node]:
        """The nodes from the root (excluded) down to `node`."""
        out = []
        while node is not None and node is not self.root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        out.reverse()
        return out

    def nodes(self):
        """Every node but the root, parents before their descendants."""
        return self._nodes()

    # ----------------------------------------------------------------------------------- extension points
    def _swa_present(self, node: Node) -> list[Any]:
        """Per token of `node`: not None when its SWA KV counts for the hit rule (here: a live device slot)."""
        return node.swa

    def _holds_window(self, node: Node) -> bool:
        """Whether a tombstone leaf must stay because some other copy of a match-end window keeps it useful."""
        return False

    def _after_split(self, head: Node, tail: Node, at: int) -> None:
        """`_split` moved `tail`'s first `at` tokens into the new parent `head`."""

    def _after_leaf_added(self, leaf: Node) -> None:
        """`insert` added `leaf` (after the "stored" event)."""

    def _before_leaf_removed(self, node: Node) -> None:
        """`node` is about to leave the tree (after the "removed" event)."""

    def _before_tombstone(self, node: Node) -> None:
        """SWA eviction is about to free all of `node`'s SWA slots."""

    def _full_evictable(self, node: Node) -> bool:
        """Whether full eviction may take `node` now: an unlocked leaf."""
        return not node.children and node.full_locks == 0

    def _evict_full_node(self, node: Node) -> int:
        """Full eviction of one candidate; returns the device full slots freed."""
        return self._remove_leaf(node)

    def _node_ending_at(self, path: list[Node], n: int) -> Node:
        """The node whose span ends exactly at token n of `path` (splitting if n falls inside one)."""
        pos = 0
        for node in path:
            end = pos + len(node.key)
            if end == n:
                return node
            if end > n:
                return self._split(node, n - pos)
            pos = end
        return self.root

    # ----------------------------------------------------------------------------------- lookups
    def match_prefix(self, tokens: list[int]) -> Match:
        self.stats.lookups += 1
        path, m = self._walk(list(tokens))
        full = [s for node in path for s in node.full]  # type: ignore[union-attr]
        swa = [s for node in path for s in node.swa]
        n = self._window_safe(swa, m)
        node = self._node_ending_at(path, n) if n else self.root
        stamp = next(self._clock)
        walker: Node | None = node
        while walker is not None and walker is not self.root:
            walker.last_access = stamp
            walker = walker.parent
        self.stats.hit_tokens += n
        self.stats.raw_hit_tokens += m
        return Match(n, full[:n], swa[:n], node, m)

    def peek_prefix_length(self, tokens: list[int]) -> int:
        """The window-safe length `match_prefix(tokens)` would return, read-only: no split, no LRU refresh, no
        statistics (a scheduler scores waiting requests with it without reordering eviction)."""
        present: list[Any] = []
        i = 0
        for child, k in self._match(list(tokens)):
            present.extend(self._swa_present(child)[:k])
            i += k
        return self._window_safe(present, i)

    # ----------------------------------------------------------------------------------- locks
    def _swa_nodes(self, node: Node | None):
        """(node, window tokens still needed on reaching it) for the nodes covering the last `window` tokens
        ending at `node`."""
        need = self.window
        while node is not None and node is not self.root and need > 0:
            yield node, need
            need -= len(node.key)
            node = node.parent

    def lock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            n.full_locks += 1
            n = n.parent
        for s, need in self._swa_nodes(node):
            s.swa_need[need] = s.swa_need.get(need, 0) + 1

    def unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            if n.full_locks <= 0:
                raise RuntimeError("radix cache: full lock underflow")
            n.full_locks -= 1
            n = n.parent
        for s, need in self._swa_nodes(node):
            left = s.swa_need.get(need, 0)
            if left <= 0:
                raise RuntimeError("radix cache: SWA lock underflow")
            if left == 1:
                del s.swa_need[need]
            else:
                s.swa_need[need] = left - 1
        self.root.full_locks = max(self.root.full_locks, 1)

    # ----------------------------------------------------------------------------------- insertion
    def insert(self, tokens: list[int], full: list[int], swa: list[int | None]) -> int:
        """Takes ownership of a finished (or chunk-prefilled) sequence's slots. Slots duplicating what the
        tree already has are freed; a live SWA slot where the tree has None repairs the tree node.
        Returns how many tokens were already cached."""
        if not (len(tokens) == len(full) == len(swa)):
            raise ValueError("tokens, full and swa slots must have the same length")
        if len(tokens) % self.page_size:
            raise ValueError(f"inserts cover whole pages of {self.page_size} tokens, got {len(tokens)}")
        tokens = list(tokens)
        path, i = self._walk(tokens)
        pos = 0
        dup_full, dup_swa = [], []
        repaired = []
        for node in path:
            before = self.stats.repairs
            if node.full is None:  # host-only node (tiers): the fresh device KV makes it device-resident again
                node.full = list(full[pos : pos + len(node.key)])
            for j in range(len(node.key)):
                p = pos + j
                if full[p] != node.full[j]:
                    dup_full.append(full[p])
                mine, theirs = swa[p], node.swa[j]
                if mine is not None and mine != theirs:
                    if theirs is None:
                        node.swa[j] = mine  # repair a released / tombstoned token
                        self.stats.repairs += 1
                    else:
                        dup_swa.append(mine)
            pos += len(node.key)
            if self.stats.repairs != before:
                repaired.append(node)
        self.full_pool.free(dup_full)
        self.swa_pool.free(dup_swa)
        stamp = next(self._clock)
        for node in path:  # the path was used: it is as recent as the new leaf (parent-first among equals)
            node.last_access = stamp
        parent = path[-1] if path else self.root
        if i < len(tokens):
            if self.window > 0 and all(s is None for s in swa[i:]):
                # Every SWA slot already released: the leaf would be a tombstone no window-safe match can end
                # in (and an insert below it would need a live window of its own anyway). Not kept.
                self.full_pool.free(full[i:])
            else:
                leaf = Node(tokens[i:], list(full[i:]), list(swa[i:]), parent)
                parent.children[self._edge(leaf.key)] = leaf
                leaf.last_access = stamp
                if self.on_event is not None:
                    self.on_event("stored", leaf)
                self._after_leaf_added(leaf)
        if self.on_event is not None:
            for node in repaired:
                self.on_event("swa", node)
        return i

    def path_to(self, tokens: list[int]) -> tuple[Node, list[int], list[int | None]]:
        """For tokens fully in the tree: (node ending at their end, their full slots, their SWA slots)."""
        path, i = self._walk(list(tokens))
        if i != len(tokens):
            raise KeyError("tokens are not all in the tree")
        node = path[-1] if path else self.root
        return node, [s for n in path for s in n.full or ()], [s for n in path for s in n.swa]

    # ----------------------------------------------------------------------------------- eviction
    def _nodes(self):
        """Every node but the root, in pre-order: a parent always comes before its descendants."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _lru_heap(self, keep) -> tuple[list, dict[int, int]]:
        """A heap of (stamp, pre-order rank, node) over the nodes `keep` accepts, and every node's rank: equal
        stamps pop parent first (a path refresh and a split give a parent and its child the same stamp)."""
        rank = {}
        heap = []
        for k, n in enumerate(self._nodes()):
            rank[n.id] = k
            if keep(n):
                heap.append((n.last_access, k, n))
        heapq.heapify(heap)
        return heap, rank

    def _remove_leaf(self, node: Node) -> int:
        if self.on_event is not None:
            self.on_event("removed", node)
        self._before_leaf_removed(node)
        parent = node.parent
        assert parent is not None, "the root is never removed"
        del parent.children[self._edge(node.key)]
        if node.full is None:  # no device copy (a tier's node): nothing to free here
            return 0
        self.full_pool.free(node.full)
        self.swa_pool.free([s for s in node.swa if s is not None])
        return len(node.full)

    def _prune_tombstone_leaves(self, start: Node) -> int:
        """Removes `start` and then its ancestors while each is an unlocked tombstone leaf; returns the full
        slots freed (the caller counts them in `stats.full_evicted`, once)."""
        n: Node | None = start
        freed = 0
        while (
            n is not None
            and n is not self.root
            and not n.children
            and n.tombstone
            and n.full_locks == 0
            and n.swa_locks == 0
            and not self._holds_window(n)
        ):
            parent = n.parent
            freed += self._remove_leaf(n)
            n = parent
        return freed

    def _start(self, node: Node) -> int:
        """Tokens before `node` on its path from the root."""
        start, n = 0, node.parent
        while n is not None and n is not self.root:
            start += len(n.key)
            n = n.parent
        return start

    def window_ends(self, node: Node) -> list[int]:
        """Node-relative points where a match into `node` may end and keep its hit, so trimming keeps the W tokens
        before each: the node end and (denser checkpoints) the last multiple of `swa_checkpoint_interval` inside."""
        ends = [len(node.key)]
        K = self._checkpoint
        if K:
            start = self._start(node)
            last = (start + len(node.key) - 1) // K * K
            if last > start:
                ends.append(last - start)
        return ends

    def window_tokens(self, node: Node) -> set[int]:
        """Token indexes of `node` inside the window before one of its `window_ends`."""
        keep: set[int] = set()
        for e in self.window_ends(node):
            keep.update(range(max(0, e - self.window), e))
        return keep

    def _outside_windows(self, node: Node) -> list[tuple[int, int]]:
        """The [a, b) runs of `node`'s token indexes outside every window trimming keeps."""
        n, W = len(node.swa), self.window
        if n <= W:
            return []
        runs, pos = [], 0
        for a, b in sorted((max(0, e - W), e) for e in self.window_ends(node)):
            if a > pos:
                runs.append((pos, a))
            pos = max(pos, b)
        if pos < n:
            runs.append((pos, n))
        return runs

    def _trim_positions(self, node: Node) -> list[int]:
        """Token indexes of `node` whose SWA trimming frees: live and outside every kept window."""
        return [j for a, b in self._outside_windows(node) for j in range(a, b) if node.swa[j] is not None]

    def _trimmable(self, node: Node) -> bool:
        # list.count runs in C: the LRU scan asks this of every node on each SWA eviction
        return any(node.swa[a:b].count(None) != b - a for a, b in self._outside_windows(node))

    def evict_swa(self, num: int) -> int:
        """Frees at least `num` SWA slots if it can (LRU over unlocked nodes with live SWA), in two passes:
        1. trim: free the SWA of tokens outside the last W of a node (and outside its checkpoint window, see
           `window_ends`). A match can only end where the W tokens before it are live; node ends (where prompts
           ended or diverged) keep that window, so their hits survive — only hits ending elsewhere in a node are
           cut back. Locked nodes are trimmed too: a lock always ends at a node end (a match ending inside a node
           splits it), so the window it protects is a suffix of at most W tokens of each node it covers, which
           trimming keeps;
        2. tombstone: free whole unlocked nodes' SWA, least recently used first."""
        freed = 0
        heap, _ = self._lru_heap(self._trimmable)
        while heap and freed < num:
            _, _, node = heapq.heappop(heap)
            js = self._trim_positions(node)
            live = [node.swa[j] for j in js]
            self.swa_pool.free(live)
            for j in js:
                node.swa[j] = None
            freed += len(live)
            if live and self.on_event is not None:
                self.on_event("swa", node)
        heap = self._lru_heap(lambda n: n.swa_locks == 0 and n.live_swa)[0] if freed < num else []
        while heap and freed < num:
            _, _, node = heapq.heappop(heap)
            self._before_tombstone(node)
            live = [s for s in node.swa if s is not None]
            self.swa_pool.free(live)
            node.swa = [None] * len(node.swa)
            freed += len(live)
            if self.on_event is not None:
                self.on_event("swa", node)
            self.stats.full_evicted += self._prune_tombstone_leaves(node)
        self.stats.swa_evicted += freed
        return freed

    def make_room(self, full: int, swa: int, min_full: int = 0, min_swa: int = 0) -> bool:
        """Evicts what is needed (at least `min_*` at a time when it must evict: a low watermark amortises the
        LRU scan) so that `full` and `swa` slots are free; returns whether they are."""
        if self.full_pool.available() < full:
            self.evict_full(max(full - self.full_pool.available(), min_full))
        if self.swa_pool.available() < swa:
            self.evict_swa(max(swa - self.swa_pool.available(), min_swa))
        return self.full_pool.available() >= full and self.swa_pool.available() >= swa

    def evict_full(self, num: int) -> int:
        """Frees at least `num` full slots if it can: LRU over the `_full_evictable` nodes (unlocked leaves here);
        a parent that becomes one joins the queue, or goes at once if it is a useless tombstone leaf."""
        heap, rank = self._lru_heap(self._full_evictable)
        freed = 0
        while heap and freed < num:
            _, _, node = heapq.heappop(heap)
            if (
                not self._full_evictable(node)
                or node.parent is None
                or node.parent.children.get(self._edge(node.key)) is not node
            ):
                continue
            parent = node.parent
            freed += self._evict_full_node(node)
            if parent is not self.root and self._full_evictable(parent):
                if (
                    not parent.children
                    and parent.tombstone
                    and parent.swa_locks == 0
                    and not self._holds_window(parent)
                ):  # a tombstone leaf is useless: goes now
                    freed += self._prune_tombstone_leaves(parent)
                else:
                    heapq.heappush(heap, (parent.last_access, rank[parent.id], parent))
        self.stats.full_evicted += freed
        return freed

    # ----------------------------------------------------------------------------------- accounting
    def accounting(self) -> "CacheAccounting":
        """Slots the tree holds, split into evictable and protected (locked), per pool."""
        full, swa = HeldSlots(), HeldSlots()
        for n in self._nodes():
            held = len(n.full) if n.full is not None else 0
            if n.full_locks:
                full.protected += held
            else:
                full.evictable += held
            if n.swa_locks:
                swa.protected += n.live_swa
            else:
                swa.evictable += n.live_swa
        return CacheAccounting(full, swa)

    def full_evictable(self) -> int:
        """Full slots held by unlocked nodes (`accounting().full.evictable` without the SWA half, which costs a pass
        over every SWA slot): what the scheduler's admission asks, at most once a step."""
        total = 0
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.full is not None and not n.full_locks:
                total += len(n.full)
            stack.extend(n.children.values())
        return total

    def token_count(self) -> int:
        return sum(len(n.key) for n in self._nodes())
