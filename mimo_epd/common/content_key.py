"""Content keys: what identifies a media item's embedding.

key = xxh3-128( xxh3-128(raw bytes) || model id || preprocessing fingerprint || extra )

The inner digest depends on the bytes only, so the same file gives the same key whether it came as
a URL, inline bytes or a local path; the outer one adds everything that changes the embedding
(model weights and dtype, preprocessing bounds, video sampling parameters), so a change of any of
them never serves a stale entry. Clients may send the inner digest as `content_hash`.
"""

from __future__ import annotations

import xxhash


def bytes_digest(data: bytes | memoryview) -> str:
    """Hex xxh3-128 of the raw bytes (the client-visible `content_hash`)."""
    return xxhash.xxh3_128_hexdigest(data)


def content_key(data_digest: str, model_id: str, preprocess_fingerprint: str, extra: str = "") -> str:
    """Hex 128-bit key of an item's embedding."""
    h = xxhash.xxh3_128()
    for part in (data_digest, model_id, preprocess_fingerprint, extra):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little"))  # length-prefixed: no ambiguity between fields
        h.update(b)
    return h.hexdigest()


def codes_key(key: str) -> str:
    """Hex 128-bit key of an audio item's codes (MiMo's audio tokenizer output), derived from its embedding's key:
    the same item, model and settings, another entry."""
    return content_key(key, "audio-codes", "", "")


def normalize_digest(value: str) -> str:
    """Validates a client-supplied content_hash (32 hex digits); returns it lower-cased."""
    v = value.strip().lower()
    if len(v) != 32 or any(c not in "0123456789abcdef" for c in v):
        raise ValueError(f"content_hash must be 32 hex digits (xxh3-128 of the bytes), got {value!r}")
    return v
