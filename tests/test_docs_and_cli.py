"""The README documents every flag with its real default and every subcommand; the CLI parses them."""
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from encoder_server.config import EncoderServerConfig
from mimo_epd.cli import build_parser
from tests.conftest import ROOT

README = Path(ROOT, "README.md").read_text()


def _default_text(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return '""' if value == "" else str(value)


@pytest.mark.parametrize("f", fields(EncoderServerConfig), ids=lambda f: f.name)
def test_every_encoder_flag_documented_with_its_default(f):
    flag = "--" + f.name.replace("_", "-")
    rows = [line for line in README.splitlines() if line.startswith(f"| `{flag}`")]
    assert rows, f"README has no row for {flag}"
    assert f"| `{_default_text(f.default)}` |" in rows[0], f"README default for {flag} is not {f.default!r}: {rows[0]}"


def test_readme_opens_with_the_two_commands():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make serve", "make test"]


def test_every_subcommand_documented():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in sub.choices:
        assert f"`mimo-epd {name}" in README, name


def test_config_parses_and_validates():
    args = build_parser().parse_args(["encoder", "--port", "0", "--allow-private-urls", "--max-wait-ms", "2.5"])
    cfg = EncoderServerConfig.from_args(args)
    assert cfg.port == 0 and cfg.allow_private_urls and cfg.max_wait_ms == 2.5
    with pytest.raises(ValueError, match="--max-batch-tokens must be positive"):
        EncoderServerConfig.from_args(build_parser().parse_args(["encoder", "--max-batch-tokens", "0"]))


def test_version_command_names_the_pil_build():
    r = subprocess.run([sys.executable, "-m", "mimo_epd", "version"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0
    assert re.search(r"^pil: (pillow-simd|pillow) \d", r.stdout, re.M), r.stdout


def test_bad_flag_value_exits_2():
    r = subprocess.run([sys.executable, "-m", "mimo_epd", "encoder", "--resize-backend", "magic"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--resize-backend" in r.stderr


def _subparsers(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sp in action.choices.items():
                yield (*prefix, name), sp
                yield from _subparsers(sp, (*prefix, name))


def test_every_flag_of_every_command_is_in_the_readme():
    missing = []
    for path, sp in _subparsers(build_parser()):
        for action in sp._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help" and not opt.startswith("--no-") and opt not in README:
                    missing.append(f"{' '.join(path)} {opt}")
    assert not missing, missing
