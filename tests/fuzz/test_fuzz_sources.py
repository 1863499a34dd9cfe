"""URLs and local paths fuzzed through a real encoder running the default URL policy (no --url-allowlist)
and --allowed-local-dir on a temporary directory.

URLs: schemes, userinfo (with '@' tricks), hosts (every spelling of loopback / private / metadata
addresses, unicode and IDNA names, fullwidth digits, ideographic dots), ports (0, 65535, out of range,
junk), percent-encoding and very long paths. A canary TCP listener on 127.0.0.1 (and ::1) is the target
of every loopback spelling: it must never see a connection. No generated URL can succeed (nothing is
allowed to be fetched here), except `data:` URIs.

Paths: NUL bytes, components longer than NAME_MAX, paths longer than PATH_MAX, `..` traversal, `//`,
symlinks out of the directory (to a file and to a directory), a symlink loop, a FIFO (reading it would
block forever), a directory, an empty file, a sparse file over --max-item-bytes. A path may succeed only
when its real path is inside the directory; a symlink out of it never serves the outside file's bytes.
"""

from __future__ import annotations

import base64
import os
import socket
import threading

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mimo_epd.v1 import encoder_pb2 as pb
from tests.conftest import encode_image, textured
from tests.fuzz.conftest import fuzz_settings

pytestmark = pytest.mark.integration

JPEG = encode_image(textured(64, 80, seed=9), "JPEG")
OUTSIDE_JPEG = encode_image(textured(64, 80, seed=10), "JPEG")
URL_ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
PATH_ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
}


# ------------------------------------------------------------------------------------------ canary
class Canary:
    """Listens on 127.0.0.1 and ::1 (same port) and counts every connection it accepts."""

    def __init__(self):
        self.hits: list[str] = []
        self.v4 = socket.create_server(("127.0.0.1", 0))
        self.port = self.v4.getsockname()[1]
        self.socks = [self.v4]
        try:
            self.socks.append(socket.create_server(("::1", self.port), family=socket.AF_INET6))
        except OSError:
            pass
        for s in self.socks:
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                c, addr = s.accept()
            except OSError:
                return
            self.hits.append(str(addr))
            c.close()

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.fixture(scope="module")
def canary():
    c = Canary()
    yield c
    c.close()


def loopback_spellings(port: int) -> list[str]:
    return [
        "127.0.0.1",
        "127.1",
        "127.0.1",
        "2130706433",
        "0x7f000001",
        "0x7f.0.0.1",
        "0177.0.0.1",
        "017700000001",
        "127.000.000.001",
        "0",
        "0.0.0.0",
        "localhost",
        "LOCALHOST.",
        "localhost.localdomain",
        "[::1]",
        "[::]",
        "[0:0:0:0:0:0:0:1]",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[::127.0.0.1]",
        "[0:0:0:0:0:ffff:127.0.0.1]",
        "[64:ff9b::127.0.0.1]",
        "[2002:7f00:1::]",
        "[::1%25lo]",
        "\uff11\uff12\uff17\uff0e\uff10\uff0e\uff10\uff0e\uff11",  # fullwidth digits and dots
        "127\u30020\u30020\u30021",
        "127\uff610\uff610\uff611",  # ideographic / halfwidth full stops
        "\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54",  # fullwidth "localhost"
        "localhost\u200b",
        "xn--localhost",
        "127.0.0.1.nip.io",
        "127.0.0.1.",
        "169.254.169.254",
        "[fd00:ec2::254]",
        "metadata.google.internal",
        "10.0.0.1",
        "192.168.0.1",
        "100.64.0.1",
        "[fe80::1]",
        "[fec0::1]",
        "224.0.0.1",
        "255.255.255.255",
    ]


@st.composite
def urls(draw, port: int) -> str:
    scheme = draw(
        st.sampled_from(
            [
                "http",
                "https",
                "HTTP",
                "hTtPs",
                "ftp",
                "file",
                "gopher",
                "ws",
                "javascript",
                "dict",
                "ldap",
                "",
                "http\x00",
                "h\u0074tp",
            ]
        )
    )
    sep = draw(st.sampled_from(["://", ":/", ":", ":///", "://\\\\", ":\\\\"]))
    userinfo = draw(
        st.sampled_from(["", "user@", "user:pass@", "example.com@", "a:b@c@", "%40@", "\u00fc\u00f1@"])
        | st.text(max_size=12).map(lambda t: t + "@")
    )
    host = draw(
        st.sampled_from(loopback_spellings(port))
        | st.text(min_size=1, max_size=40)
        | st.sampled_from(
            [
                "example.com",
                "b\u00fccher.example",
                "xn--bcher-kva.example",
                "\u4f8b\u5b50.\u6d4b\u8bd5",
                "a" * 300 + ".com",
                "-bad-.com",
                "exa mple.com",
                "[::1",
                "1.2.3.4.5",
                "[1:2:3]",
            ]
        )
    )
    port_part = draw(
        st.sampled_from(
            [f":{port}", "", ":0", ":65535", ":65536", ":99999", ":-1", ":abc", ": 80", f":{port:05d}", f":0{port}"]
        )
    )
    path = draw(
        st.sampled_from(["/", "/x.jpg", "/%2e%2e/%2e%2e/etc/passwd", "/a?b=c#d", "/\u00e9\u00e8.png", ""])
        | st.text(max_size=60).map(lambda t: "/" + t)
        | st.integers(1000, 100_000).map(lambda n: "/" + "a" * n)
    )
    return f"{scheme}{sep}{userinfo}{host}{port_part}{path}"


def test_every_loopback_spelling_is_refused_without_a_connection(fuzz_server, canary):
    for host in loopback_spellings(canary.port):
        url = f"http://{host}:{canary.port}/x.jpg"
        out = fuzz_server.encode(pb.MediaItem(url=url), deadline_s=20)
        assert out.code in {
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNAVAILABLE,
        }, (url, out)
    assert canary.hits == [], f"the server connected to the loopback canary: {canary.hits}"


@fuzz_settings(60)
@given(data=st.data())
def test_fuzzed_urls(fuzz_server, canary, data):
    url = data.draw(urls(canary.port))
    out = fuzz_server.encode(pb.MediaItem(url=url), deadline_s=20)
    assert out.code in URL_ALLOWED, (url, out)
    if out.code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the server's own fetch deadline, named as such
        assert "--fetch-timeout-s" in out.details or "longer than" in out.details, (url, out)
    assert canary.hits == [], f"{url!r} reached the loopback canary: {canary.hits}"


@fuzz_settings(30)
@given(
    mime=st.sampled_from(["image/jpeg", "image/png", "", "text/plain", "image/jpeg;charset=utf-8", "x/\u00e9"])
    | st.text(max_size=20),
    b64=st.booleans(),
    payload=st.sampled_from([JPEG, JPEG[:100], b"", b"\x00" * 50]) | st.binary(max_size=200),
    junk=st.sampled_from(["", "%", "%zz", "==", "\n", " ", "\u00e9", ";base64"]),
)
def test_fuzzed_data_uris(fuzz_server, mime, b64, payload, junk):
    body = base64.b64encode(payload).decode() if b64 else payload.decode("latin-1")
    uri = f"data:{mime}{';base64' if b64 else ''},{body}{junk}"
    out = fuzz_server.encode(pb.MediaItem(url=uri), deadline_s=20)
    assert out.code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, (uri[:200], out)


# ------------------------------------------------------------------------------------------ paths
@pytest.fixture(scope="module")
def tree(media_dir, tmp_path_factory):
    """Files inside the allowed directory, and links from it to things outside."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.jpg").write_bytes(OUTSIDE_JPEG)
    (media_dir / "good.jpg").write_bytes(JPEG)
    (media_dir / "sub").mkdir()
    (media_dir / "sub" / "deep.jpg").write_bytes(JPEG)
    (media_dir / "empty.jpg").write_bytes(b"")
    (media_dir / "dir.jpg").mkdir()
    with open(media_dir / "sparse.jpg", "wb") as f:  # over --max-item-bytes (8 MB) without using the disk
        f.truncate(64 << 20)
    os.mkfifo(media_dir / "fifo.jpg")
    os.symlink(outside / "secret.jpg", media_dir / "link-out.jpg")
    os.symlink(outside, media_dir / "link-dir")
    os.symlink(media_dir / "good.jpg", media_dir / "link-in.jpg")
    os.symlink(media_dir / "loop.jpg", media_dir / "loop.jpg")
    os.symlink("../" + outside.name + "/secret.jpg", media_dir / "rel-out.jpg")
    return {"root": str(media_dir), "outside": str(outside)}


NAMES = [
    "good.jpg",
    "sub",
    "deep.jpg",
    "empty.jpg",
    "dir.jpg",
    "sparse.jpg",
    "fifo.jpg",
    "link-out.jpg",
    "link-dir",
    "secret.jpg",
    "link-in.jpg",
    "loop.jpg",
    "rel-out.jpg",
    "..",
    ".",
    "",
    "nonexistent.jpg",
    "a" * 256,
    "a" * 5000,
    "good.jpg\x00.png",
    "\x00",
    "%2e%2e",
    "good.jpg/",
    "\u00e9.jpg",
    "~",
    "$HOME",
    "*",
    "good.jp?",
]


@st.composite
def paths(draw, root: str) -> str:
    parts = draw(st.lists(st.sampled_from(NAMES) | st.text(max_size=10), min_size=1, max_size=6))
    prefix = draw(
        st.sampled_from(
            [
                root,
                root + "/",
                root + "//",
                "/",
                "",
                root + "/../" + os.path.basename(root),
                "/proc/self/root" + root,
                "/dev/fd/0",
            ]
        )
    )
    return prefix + ("/" if prefix and not prefix.endswith("/") else "") + "/".join(parts)


def _inside(root: str, path: str) -> bool:
    try:
        real = os.path.realpath(path)
    except (ValueError, OSError):
        return False
    return os.path.commonpath([real, root]) == root


def test_named_paths(fuzz_server, tree):
    root = tree["root"]
    expect = {
        "good.jpg": grpc.StatusCode.OK,
        "sub/deep.jpg": grpc.StatusCode.OK,
        "link-in.jpg": grpc.StatusCode.OK,
        "link-out.jpg": grpc.StatusCode.PERMISSION_DENIED,
        "rel-out.jpg": grpc.StatusCode.PERMISSION_DENIED,
        "link-dir/secret.jpg": grpc.StatusCode.PERMISSION_DENIED,
        "../outside/secret.jpg": grpc.StatusCode.PERMISSION_DENIED,
        "empty.jpg": grpc.StatusCode.INVALID_ARGUMENT,
        "sparse.jpg": grpc.StatusCode.INVALID_ARGUMENT,
    }
    for rel, code in expect.items():
        out = fuzz_server.encode(pb.MediaItem(path=f"{root}/{rel}"))
        assert out.code == code, (rel, out)


@pytest.mark.parametrize("rel", ["fifo.jpg", "dir.jpg", "loop.jpg", "nonexistent.jpg"])
def test_special_files_are_refused_without_blocking(fuzz_server, tree, rel):
    out = fuzz_server.encode(pb.MediaItem(path=f"{tree['root']}/{rel}"), deadline_s=15)
    assert out.code in {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
    }, out


# Regressions: these came back INTERNAL (OSError ENAMETOOLONG, ValueError "embedded null byte") from the
# local-path reader before it mapped them to INVALID_ARGUMENT.
@pytest.mark.parametrize(
    "rel",
    [
        pytest.param("a" * 256 + ".jpg", id="name-over-NAME_MAX"),
        pytest.param(("a" * 200 + "/") * 25 + "x.jpg", id="path-over-PATH_MAX"),
        pytest.param("good.jpg\x00.png", id="nul-byte"),
    ],
)
def test_malformed_paths_get_a_client_status(fuzz_server, tree, rel):
    out = fuzz_server.encode(pb.MediaItem(path=f"{tree['root']}/{rel}"))
    assert out.code in {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}, out


@pytest.fixture(scope="module")
def outside_key(fuzz_server):
    return fuzz_server.encode(pb.MediaItem(data=OUTSIDE_JPEG)).resp.items[0].content_key


@fuzz_settings(50)
@given(data=st.data())
def test_fuzzed_paths(fuzz_server, tree, outside_key, data):
    path = data.draw(paths(tree["root"]))
    out = fuzz_server.encode(pb.MediaItem(path=path), deadline_s=15)
    assert out.code in PATH_ALLOWED, (path, out)
    if out.code == grpc.StatusCode.OK:
        assert _inside(tree["root"], path), f"{path!r} is outside the allowed directory and was served"
        assert out.resp.items[0].content_key != outside_key, f"{path!r} served the file outside the directory"
