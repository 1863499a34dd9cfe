"""One flag source for every command: a dataclass whose fields are the flags.

Each field carries its help text (and optionally an argparse group, choices, a flag name of its own and `aliases`,
other names of the same flag such as `--tp`) in its metadata; the CLI builds its flags from the fields, and
`from_args` builds the dataclass back from the parsed
namespace, so a default is written once. `prefix` lets one command expose another's flags under a prefix
(`serve` passes every LLM-worker flag through as `--llm-*`). A field declared with `embedded(Cls)` holds another
flag dataclass whose fields are flags of the same command (the LLM router's config embeds the policies'
`PolicyConfig`); the namespace's dest of every flag is its field's name (with the prefix), whatever the flag is
called.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def flag(default: Any, help: str, group: str = "", choices: tuple | None = None, name: str = "", **kw):
    """A dataclass field that is also a command-line flag (`--<field-name>` unless `name` says otherwise)."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices, "name": name, **kw})


def embedded(cls):
    """A field holding another flag dataclass: its fields are flags of the same command."""
    return field(default_factory=cls, metadata={"embedded": cls})


def _embedded(f):
    return f.metadata.get("embedded")


def _is_flag(f) -> bool:
    """A field declared with `field(..., metadata={"flag": False})` is set by code, not on the command line."""
    return f.metadata.get("flag", True) is not False


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _type_of(f) -> type:
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    return _TYPES.get(name, str)


def flag_name(name: str, prefix: str = "", field_=None) -> str:
    own = field_.metadata.get("name") if field_ is not None else ""
    return "--" + (prefix + (own or name)).replace("_", "-")


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
        if (only is not None and f.name not in only) or f.name in skip or not _is_flag(f):
            continue
        if _embedded(f):
            add_arguments(parser, _embedded(f), prefix=prefix, skip=skip, default_group=default_group)
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
        names = [flag_name(f.name, prefix, f), *(flag_name(a, prefix) for a in f.metadata.get("aliases", ()))]
        if typ is bool:
            target.add_argument(
                *names,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        else:
            target.add_argument(
                *names,
                dest=dest,
                type=typ,
                default=default,
                help=help_text,
                choices=f.metadata.get("choices"),
            )


def from_args(cls, args: argparse.Namespace, prefix: str = "", **overrides):
    """The dataclass built from parsed flags (fields missing from `args` keep their defaults)."""
    kw = {}
    for f in fields(cls):
        if not _is_flag(f):
            continue
        if _embedded(f):
            kw[f.name] = from_args(_embedded(f), args, prefix)
        elif hasattr(args, prefix + f.name):
            kw[f.name] = getattr(args, prefix + f.name)
    kw.update(overrides)
    return cls(**kw)


def to_argv(cfg, prefix: str = "", skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The flags that reproduce `cfg` (non-default fields only), e.g. to start a child process with it."""
    defaults = type(cfg)()
    out: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or not _is_flag(f) or value == getattr(defaults, f.name):
            continue
        if _embedded(f):
            out += to_argv(value, prefix, skip)
            continue
        name = flag_name(f.name, prefix, f)
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name[2:])
        else:
            out += [name, str(value)]
    return out


__all__ = ["flag", "embedded", "add_arguments", "from_args", "to_argv", "flag_name", "dataclass"]
