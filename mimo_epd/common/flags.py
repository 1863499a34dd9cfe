"""One flag source for every command: a dataclass whose fields are the flags.

Each field carries its help text (and optionally an argparse group and choices) in its metadata; the CLI
builds its flags from the fields, and `from_args` builds the dataclass back from the parsed namespace, so a
default is written once. `prefix` lets one command expose another's flags under a prefix (`serve` passes every
LLM-worker flag through as `--llm-*`).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def flag(default: Any, help: str, group: str = "", choices: tuple | None = None, **kw):
    """A dataclass field that is also a command-line flag."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices, **kw})


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _type_of(f) -> type:
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    return _TYPES.get(name, str)


def flag_name(name: str, prefix: str = "") -> str:
    return "--" + (prefix + name).replace("_", "-")


def add_arguments(
    parser: argparse.ArgumentParser,
    cls,
    only: set[str] | None = None,
    prefix: str = "",
    skip: frozenset[str] | set[str] = frozenset(),
    default_group: str = "",
) -> None:
    """Adds one flag per field of `cls` (grouped by the fields' `group` metadata)."""
    groups: dict[str, Any] = {}
    for f in fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        title = f.metadata.get("group") or default_group
        target = parser
        if title:
            if title not in groups:
                existing = next((g for g in parser._action_groups if g.title == title), None)
                groups[title] = existing or parser.add_argument_group(title)
            target = groups[title]
        default = f.default if f.default is not MISSING else None
        help_text = f"{f.metadata.get('help', '')} (default: {default!r})"
        dest = prefix + f.name
        typ = _type_of(f)
        if typ is bool:
            target.add_argument(
                flag_name(f.name, prefix),
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        else:
            target.add_argument(
                flag_name(f.name, prefix),
                dest=dest,
                type=typ,
                default=default,
                help=help_text,
                choices=f.metadata.get("choices"),
            )


def from_args(cls, args: argparse.Namespace, prefix: str = "", **overrides):
    """The dataclass built from parsed flags (fields missing from `args` keep their defaults)."""
    kw = {f.name: getattr(args, prefix + f.name) for f in fields(cls) if hasattr(args, prefix + f.name)}
    kw.update(overrides)
    return cls(**kw)


def to_argv(cfg, prefix: str = "", skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The flags that reproduce `cfg` (non-default fields only), e.g. to start a child process with it."""
    defaults = type(cfg)()
    out: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or value == getattr(defaults, f.name):
            continue
        name = flag_name(f.name, prefix)
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name[2:])
        else:
            out += [name, str(value)]
    return out


__all__ = ["flag", "add_arguments", "from_args", "to_argv", "flag_name", "dataclass"]
