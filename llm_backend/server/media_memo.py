"""What the encoder answered for media this worker has seen, so that a request whose media KV the prefix cache
still holds skips the encoder entirely (`--media-memo-items`).

A media item's placeholder ids come from its content key and row count (`placeholder_ids`), so once the encoder
has answered for an item, the worker can lay out the next prompt with that item itself. If the prefix cache holds
the prompt up to and past its last media row (`LLM.cached_prefix_length`), the rows are never read: the request
goes to the engine without them (`media_span`), and the engine's admission makes sure the cache still holds them
(else the request comes back at once, MEDIA_NEEDED, and is encoded as usual: core.Generation).

- **Key**: the item's bytes (xxh3-128 of `data`, or the client's `content_hash` for a URL or path item; an item
  with neither is never remembered: its bytes are unknown until fetched), its modality and its video options.
- **Value**: the item's `ItemRows` as the encoder's reply gave them (kind, ids, video groups, end), the soundtrack
  flag set per request. Bounded LRU; forgotten wholesale when the encoder answers with another model id (its
  content keys, hence the ids, change with it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

import xxhash

from mimo_epd.common.omni_prompt import ItemRows


def memo_key(item) -> tuple | None:
    which = item.WhichOneof("source")
    if which == "data":
        digest = xxhash.xxh3_128_hexdigest(item.data)
    elif item.content_hash:
        digest = item.content_hash.lower()
    else:
        return None
    v = item.video
    return digest, int(item.modality), v.fps, v.max_frames, v.min_frames


class MediaMemo:
    def __init__(self, max_items: int):
        self.max_items = max_items
        self.model = ""
        self._items: OrderedDict[tuple, ItemRows] = OrderedDict()
        self._lock = threading.Lock()

    def learn(self, keys: list[tuple | None], rows: list[ItemRows], model: str) -> None:
        """Remembers the encoder's answer for each item that has a key (`memo_key`, computed once per request)."""
        with self._lock:
            if model != self.model:
                self._items.clear()
                self.model = model
            for key, r in zip(keys, rows):
                if key is not None:
                    self._items[key] = replace(r, in_video=False)
                    self._items.move_to_end(key)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def lookup(self, keys: list[tuple | None], in_video: list[bool]) -> list[ItemRows] | None:
        """Every item's rows as last answered (`in_video`: which items are a video's soundtrack in this request),
        or None unless all of them are known."""
        out = []
        with self._lock:
            for i, key in enumerate(keys):
                r = self._items.get(key) if key is not None else None
                if r is None:
                    return None
                self._items.move_to_end(key)
                out.append(replace(r, in_video=in_video[i]))
        return out

    def __len__(self) -> int:
        return len(self._items)
