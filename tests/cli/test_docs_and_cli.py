"""The CLI's reference (docs/cli.md) is what the parsers generate; the README opens with the two commands; the
CLI parses, validates, stays light (no torch for --help / health / encode) and keeps stdout for results."""

import base64
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from encoder_server.config import EncoderServerConfig
from mimo_epd.cli import build_parser
from mimo_epd.cli.clients import item_name
from mimo_epd.cli.docs import render
from tests.conftest import ROOT

README = Path(ROOT, "README.md").read_text()
CLI_MD = Path(ROOT, "docs", "cli.md")


def _run(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "mimo_epd", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=kw.pop("cwd", ROOT),
        **kw,
    )


def test_readme_opens_with_the_two_commands():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make serve", "make test"]


def test_cli_reference_is_current():
    """docs/cli.md is generated (every command, flag, default and help); regenerate it with `make docs`."""
    assert CLI_MD.exists(), "docs/cli.md is missing: run `make docs`"
    assert render(build_parser()) == CLI_MD.read_text(), "docs/cli.md is stale: run `make docs`"


def test_cli_reference_lists_every_flag_of_every_command():
    """A check of the generator itself: each option of each (sub)command appears under its command's heading."""
    from mimo_epd.cli import complete, walk

    text = CLI_MD.read_text()
    sections = dict(re.findall(r"^## (mimo-epd[^\n]*)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    for path, parser in walk(complete(build_parser())):
        body = sections[" ".join(("mimo-epd", *path))]
        for action in parser._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help":
                    assert f"`{opt}" in body, f"mimo-epd {' '.join(path)} {opt}"
    serve = sections["mimo-epd serve"]
    assert "| `--encoders N` | `1` |" in serve and "**LLM worker**" in serve and "**node**" in serve


def test_serve_help_is_grouped():
    r = _run("serve", "--help")
    assert r.returncode == 0
    titles = re.findall(r"^(\S[^\n]*):$", r.stdout, re.M)
    for title in ("node", "routing", "LLM worker", "encoder: limits", "video", "cache"):
        assert title in titles, titles
    assert r.stdout.startswith("usage: mimo-epd serve [MODEL] [FLAGS]")


def test_top_level_help_is_for_users():
    r = _run("--help")
    assert r.returncode == 0 and "quick start:" in r.stdout and "mimo-epd serve" in r.stdout
    assert "dispatches" not in r.stdout and "Each subcommand is one function" not in r.stdout


def test_light_commands_do_not_import_torch():
    """--help (serve, router and llm too: their flags come from torch-free modules), health and encode import only
    grpc and the stubs (torch costs seconds at every call)."""
    code = """if True:
        import sys
        from mimo_epd.cli import build_parser, main
        build_parser()
        assert "torch" not in sys.modules, "build_parser"
        for argv in (["health", "--server", "127.0.0.1:1", "--timeout", "0.2"],
                     ["encode", "--server", "127.0.0.1:1", "--timeout", "0.2", sys.argv[1]],
                     ["--help"], ["health", "--help"], ["encode", "--help"], ["generate", "--help"],
                     ["serve", "--help"], ["router", "--help"], ["llm", "--help"],
                     ["bench", "routing-live", "--help"]):
            try:
                main(argv)
            except SystemExit:
                pass
            assert "torch" not in sys.modules, argv
        print("ok")
    """
    r = subprocess.run(
        [sys.executable, "-c", code, str(Path(ROOT, "README.md"))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_config_parses_and_validates():
    args = build_parser().parse_args(["encoder", "--port", "0", "--allow-private-urls", "--max-wait-ms", "2.5"])
    cfg = EncoderServerConfig.from_args(args)
    assert cfg.port == 0 and cfg.allow_private_urls and cfg.max_wait_ms == 2.5
    with pytest.raises(ValueError, match="--max-batch-tokens must be positive"):
        EncoderServerConfig.from_args(build_parser().parse_args(["encoder", "--max-batch-tokens", "0"]))


def test_bad_flag_value_exits_2():
    r = _run("encoder", "--resize-backend", "magic")
    assert r.returncode == 2 and "--resize-backend" in r.stderr


def test_client_defaults_point_at_make_serve():
    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x"]).server == "127.0.0.1:50051"
    assert p.parse_args(["health"]).server == "127.0.0.1:50051"
    assert p.parse_args(["encode", "a.jpg"]).server == "127.0.0.1:50051"


# ---------------------------------------------------------------------------------------------- encode items
@pytest.mark.parametrize("item", ["ftp://example.com/a.png", "file:///etc/passwd", "s3://bucket/key.jpg"])
def test_other_schemes_are_unsupported_not_unreadable_files(item):
    r = _run("encode", "--server", "127.0.0.1:1", item)
    assert r.returncode == 2
    assert f"unsupported scheme {item.split(':')[0]}://" in r.stderr and "cannot read" not in r.stderr, r.stderr


def test_missing_file_is_named():
    r = _run("encode", "--server", "127.0.0.1:1", "no-such-photo.jpg")
    assert r.returncode == 2 and "cannot read no-such-photo.jpg: No such file or directory" in r.stderr


def test_data_uri_item_names_are_short():
    payload = b"\xff\xd8" + bytes(range(256)) * 40
    assert (
        item_name("data:image/jpeg;base64," + base64.b64encode(payload).decode())
        == f"data:image/jpeg;{len(payload)} bytes"
    )
    assert item_name("data:image/png;base64," + base64.b64encode(b"abcd").decode()) == "data:image/png;4 bytes"
    assert item_name("data:,a%20b") == "data:text/plain;3 bytes"
    assert item_name("photo.jpg") == "photo.jpg"


# ---------------------------------------------------------------------------------------------- version
def test_version_command_names_the_pil_build():
    r = _run("version")
    assert r.returncode == 0
    assert re.search(r"^pil: (pillow-simd|pillow) \d", r.stdout, re.M), r.stdout


def _fake_pil(root: Path, version: str, simd_hash_matches: bool) -> None:
    """A PIL package whose files pillow installed over pillow-simd's (or the reverse): both distributions'
    RECORDs list PIL/_version.py; only the one that wrote it last has the file's hash."""
    pkg = root / "PIL"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from ._version import __version__\n")
    body = f"__version__ = {version!r}\n".encode()
    (pkg / "_version.py").write_bytes(body)
    good = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
    bad = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(b"other").digest()).rstrip(b"=").decode()
    for name, dist_version, matches in (
        ("pillow_simd", "12.1.1.post0", simd_hash_matches),
        ("pillow", "11.0.0", not simd_hash_matches),
    ):
        info = root / f"{name}-{dist_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {dist_version}\n"
        )
        (info / "top_level.txt").write_text("PIL\n")
        (info / "RECORD").write_text(f"PIL/__init__.py,,\nPIL/_version.py,{good if matches else bad},{len(body)}\n")


@pytest.mark.parametrize(
    "simd_wrote_last,expected", [(False, "pillow 11.0.0 (pillow-simd not active"), (True, "pillow-simd 12.1.1.post0")]
)
def test_version_reports_the_pil_that_is_really_loaded(tmp_path, simd_wrote_last, expected):
    """pip installing pillow over pillow-simd leaves pillow-simd's metadata behind: the check follows the files."""
    _fake_pil(tmp_path, "12.1.1.post0" if simd_wrote_last else "11.0.0", simd_wrote_last)
    code = "import PIL; from mimo_epd.cli.version import pil_line; print(PIL.__file__); print(pil_line())"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )
    assert r.returncode == 0, r.stderr
    loaded, line = r.stdout.strip().splitlines()
    assert loaded.startswith(str(tmp_path)), loaded
    assert line.startswith(expected), line


# ---------------------------------------------------------------------------------------------- stdout is for results
@pytest.mark.integration
def test_video_commands_keep_stdout_for_json(tmp_path):
    """`make-test-video` and `encode-video` print exactly one JSON object on stdout (`| jq` works); the progress
    bars (count, rate, ETA) go to stderr and end with a newline."""
    video = tmp_path / "clip.mp4"
    r = _run("make-test-video", "--seconds", "2", "--width", "160", "--height", "96", "--out", str(video))
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout)
    assert info["frames"] == 60 and video.exists()
    assert "60/60" in r.stderr and "frames/s" in r.stderr and r.stderr.endswith("\n")
    r = _run("encode-video", str(video), "--workers", "1", "--fps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["video"] == str(video) and summary["frames_sampled"] > 0
    assert "encoded" in r.stderr and "frames/s" in r.stderr


def test_the_repository_is_self_contained():
    """No tracked file names a path outside the repository (a shared folder beside it, a design note that ships
    elsewhere): what the product relies on is in the repository."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"\.\./shared|shared/traces|shared/design|reference\.md §")
    offenders = []
    for name in files:
        if name == "tests/cli/test_docs_and_cli.py" or not name.endswith((".py", ".md", ".toml", ".sh", "Makefile")):
            continue
        text = Path(ROOT, name).read_text(errors="replace")
        offenders += [f"{name}: {m.group(0)}" for m in outside.finditer(text)]
    assert not offenders, offenders


def test_the_shipped_trace_is_the_default_and_complete():
    from mimo_epd.data import MOONCAKE_TRACE, open_text

    with open_text(MOONCAKE_TRACE) as f:
        rows = [json.loads(x) for x in f]
    assert len(rows) == 12031 and all(r["hash_ids"] and r["input_length"] > 0 for r in rows)


def test_generated_text_on_a_terminal_has_its_control_bytes_escaped():
    from mimo_epd.cli.clients import shown

    assert shown("a\x1b[2Jb\rc\x07\td\né\x9b") == "a\\x1b[2Jb\\rc\\x07\td\né\\x9b"
    assert shown("plain text\n") == "plain text\n"


def test_pd_flags_start_exactly_what_they_name():
    """`serve --pd-prefill-workers 1 --pd-decode-workers 1` is a 1P+1D node: no colocated worker beside them
    unless --llm-workers asks for one; without P/D flags the node keeps its one colocated worker."""
    from mimo_epd.launcher.config import NodeConfig

    def node(*flags):
        return NodeConfig.from_args(build_parser().parse_args(["serve", *flags]))

    pd = node("--pd-prefill-workers", "1", "--pd-decode-workers", "1")
    assert (pd.llm_workers, pd.pd_prefill_workers, pd.pd_decode_workers) == (0, 1, 1)
    both = node("--pd-prefill-workers", "1", "--pd-decode-workers", "1", "--llm-workers", "1")
    assert (both.llm_workers, both.pd_prefill_workers, both.pd_decode_workers) == (1, 1, 1)
    assert node().llm_workers == 1 and node("--llm-workers", "3").llm_workers == 3
    with pytest.raises(ValueError, match="at least one worker that decodes"):
        node("--llm-workers", "0")
