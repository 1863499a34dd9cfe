"""Smaller leaks at the media edge: a URL's credentials never appear in an error (redacted everywhere), a
percent-encoded host is the client's 400 (not DNS and a 503), and an image sent as a video (or a video as an
image) is refused naming both kinds."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from encoder_server.errors import ItemError
from encoder_server.fetch.url_policy import UrlPolicy
from encoder_server.media_kind import mismatch, sniff
from mimo_epd.common.redact import redact_url


def test_redact_url():
    assert redact_url("http://user:s3cret@host:80/p?q=1") == "http://***@host:80/p?q=1"
    assert redact_url("https://a@b:c@host/x@y") == "https://***@host/x@y"
    assert redact_url("http://host/p@q") == "http://host/p@q"
    assert redact_url("not a url :// pw@x") == "not a url ://***@x"
    assert "s3cret" not in redact_url("http://u:s3cret@%zz:99999999/")
    assert len(redact_url("data:" + "A" * 10_000)) < 210


def test_malformed_url_does_not_echo_the_password_and_percent_hosts_are_invalid():
    policy = UrlPolicy()
    for url in ("http://u:s3cret@host:99999999/x", "http://u:s3cret@[::1/x"):
        with pytest.raises(ItemError) as e:
            policy.check_url(url)
        assert "s3cret" not in str(e.value) and "s3cret" not in e.value.reason
    with pytest.raises(ItemError) as e:
        policy.check_url("http://%41%42/x.png")
    assert e.value.code.name == "INVALID_ARGUMENT" and "percent-encoded" in e.value.reason


def test_sniff_kinds(images):
    png = b"\x89PNG\r\n\x1a\n" + bytes(32)
    mp4 = b"\x00\x00\x00\x18ftypmp42" + bytes(32)
    assert sniff(images["a.jpg"]) == ("image", "JPEG") and sniff(png) == ("image", "PNG")
    assert sniff(mp4) == ("video", "MP4/MOV") and sniff(b"\x1a\x45\xdf\xa3" + bytes(8))[0] == "video"
    assert sniff(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == ("image", "WebP")
    assert mismatch(png, "video") and "image_url" in mismatch(png, "video")
    assert mismatch(mp4, "image") and "video_url" in mismatch(mp4, "image")
    assert mismatch(png, "image") is None and mismatch(mp4, "video") is None and mismatch(b"??", "video") is None


@pytest.mark.integration
def test_image_sent_as_video_is_a_400(worker, media):
    body = {
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": media.url("a.jpg")}}]}],
        "max_tokens": 1,
    }
    req = urllib.request.Request(
        f"http://{worker.http_address}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and "JPEG" in err["message"] and "image_url" in err["message"], err
