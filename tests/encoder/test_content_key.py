import pytest

from mimo_epd.common.content_key import bytes_digest, content_key, normalize_digest


def test_key_depends_on_bytes_model_and_preprocessing():
    d = bytes_digest(b"image bytes")
    base = content_key(d, "tiny/float32", "max_pixels=1")
    assert len(base) == 32 and int(base, 16) >= 0
    assert content_key(d, "tiny/float32", "max_pixels=1") == base
    assert content_key(bytes_digest(b"image bytez"), "tiny/float32", "max_pixels=1") != base
    assert content_key(d, "tiny/bfloat16", "max_pixels=1") != base
    assert content_key(d, "tiny/float32", "max_pixels=2") != base
    assert content_key(d, "tiny/float32", "max_pixels=1", extra="fps=2") != base
    # Length-prefixed fields: moving a boundary changes the key.
    assert content_key(d, "ab", "c") != content_key(d, "a", "bc")


def test_digest_is_xxh3_128():
    import xxhash

    assert bytes_digest(b"abc") == xxhash.xxh3_128_hexdigest(b"abc")


def test_normalize_digest():
    assert normalize_digest(" " + "AB" * 16 + " ") == "ab" * 16
    for bad in ("", "abc", "g" * 32, "a" * 33):
        with pytest.raises(ValueError, match="32 hex digits"):
            normalize_digest(bad)
