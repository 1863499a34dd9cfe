"""docs/cli.md, generated from the parsers: every command, every flag, its default and its help.

`make docs` (scripts/gen_cli_docs.py) writes it; tests/cli/test_docs_and_cli.py checks that regenerating gives
the committed text, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import re

HEADER = """<!-- Generated from the CLI's parsers by `make docs` (scripts/gen_cli_docs.py). Do not edit by hand:
     tests/cli/test_docs_and_cli.py fails when this file differs from what the parsers generate. -->
# `mimo-epd` command reference

Every command and every flag, with its default. `mimo-epd COMMAND --help` prints the same.
Results go to stdout (JSON lines, generated text, `ready HOST:PORT`); progress, logs and errors go to stderr.
Exit status: 0 success, 1 the operation failed, 2 bad usage or input.
"""
_DEFAULT_IN_HELP = re.compile(r"\s*\(default: [^()]*(\([^()]*\)[^()]*)*\)\s*$")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _default(action: argparse.Action) -> str:
    if action.default is argparse.SUPPRESS or action.required:
        return "required" if action.required else ""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "on" if action.default else "off"
    if isinstance(action, argparse._AppendAction):
        return "none" if not action.default else ", ".join(map(str, action.default))
    if action.default is None:
        return "none"
    if action.default == "":
        return '""'
    return str(action.default)


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return f"`{name}`" + (" ..." if action.nargs in ("+", "*") else "")
    opts = [o for o in action.option_strings if o.startswith("--")] or action.option_strings
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(f"`{o}`" for o in opts)
    value = ""
    if action.nargs != 0:
        if action.choices:
            value = " {" + ",".join(map(str, action.choices)) + "}"
        else:
            value = f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"`{o}{value}`" for o in opts)


def _help(action: argparse.Action) -> str:
    text = (action.help or "") % {"default": action.default, "prog": ""} if action.help else ""
    return _cell(_DEFAULT_IN_HELP.sub("", text))


def _actions_by_group(parser: argparse.ArgumentParser):
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        ]
        if actions:
            yield group.title, actions


def render(parser: argparse.ArgumentParser) -> str:
    from .registry import complete, walk

    complete(parser)
    out = [HEADER]
    commands = list(walk(parser))
    out.append("| command | what it does |\n|---|---|")
    helps = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps.update({c.dest: c.help for c in action._choices_actions})
    for path, _sub in commands:
        if len(path) == 1:
            out.append(f"| [`mimo-epd {path[0]}`](#mimo-epd-{path[0]}) | {_cell(helps.get(path[0], ''))} |")
    out.append("")
    for path, sub in commands:
        name = " ".join(("mimo-epd", *path))
        out.append(f"## {name}\n")
        if sub.description:
            out.append(sub.description.strip() + "\n")
        groups = list(_actions_by_group(sub))
        if groups:
            for title, actions in groups:
                if title not in ("options", "optional arguments"):
                    out.append(f"**{title}**\n")
                out.append("| flag | default | meaning |\n|---|---|---|")
                for a in actions:
                    out.append(f"| {_flag(a)} | {_cell(_default(a)) and '`' + _cell(_default(a)) + '`'} | {_help(a)} |")
                out.append("")
        children = [p for p, _ in commands if p[:-1] == path]
        if children:
            out.append("Subcommands: " + ", ".join(f"`{' '.join(('mimo-epd', *c))}`" for c in children) + ".\n")
        if sub.epilog:
            out.append("```text\n" + sub.epilog.strip() + "\n```\n")
    return "\n".join(out).rstrip() + "\n"
