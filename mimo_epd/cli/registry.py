"""How the CLI's commands are declared: a tree of subcommands whose flags are added only when needed.

Why lazy: several commands take their flags from heavy modules (the benchmarks import torch at module
level). Building every subparser up front made `mimo-epd --help` and `mimo-epd health` pay for torch
(3-4 s). Here each subcommand registers a `setup(parser)` callable; it runs only when argparse actually
selects that subcommand (or when `complete()` is asked to build everything, as the docs generator does),
so a call imports only what its own command needs.

A command module (`mimo_epd/cli/<name>.py`) exposes `register(commands: Commands)` and calls
`commands.command(...)` / `commands.group(...)`; `mimo_epd/cli/__init__.py` lists the modules.
"""

from __future__ import annotations

import argparse
from typing import Callable

Setup = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

_PENDING = "_mimo_pending_setup"


class _LazySubParsers(argparse._SubParsersAction):
    """Runs a subparser's pending setup right before argparse hands it the remaining arguments."""

    def __call__(self, parser, namespace, values, option_string=None):
        sub = self._name_parser_map.get(values[0])
        if sub is not None:
            _run_pending(sub)
        return super().__call__(parser, namespace, values, option_string)


def _run_pending(parser: argparse.ArgumentParser) -> None:
    pending = getattr(parser, _PENDING, None)
    if pending:
        setattr(parser, _PENDING, None)
        for setup in pending:
            setup(parser)


class Commands:
    """One level of subcommands under `parser` (the top level, or a group such as `bench`)."""

    def __init__(self, parser: argparse.ArgumentParser, dest: str, title: str = "commands"):
        parser.register("action", "parsers", _LazySubParsers)
        self.parser = parser
        self._sub = parser.add_subparsers(dest=dest, required=True, metavar="COMMAND", title=title)

    def command(
        self,
        name: str,
        help: str,
        setup: Setup | None = None,
        run: Run | None = None,
        description: str | None = None,
        epilog: str | None = None,
        usage: str | None = None,
    ) -> argparse.ArgumentParser:
        """A subcommand. `setup(parser)` adds its flags (lazily); `run(args)` returns the exit status."""
        p = self._sub.add_parser(
            name,
            help=help,
            description=description or _sentence(help),
            epilog=epilog,
            usage=usage,
            formatter_class=HelpFormatter,
        )
        setattr(p, _PENDING, [setup] if setup else [])
        if run is not None:
            p.set_defaults(fn=run)
        return p

    def group(self, name: str, help: str, dest: str, description: str | None = None) -> "Commands":
        """A subcommand that has subcommands of its own (`mimo-epd bench encoder`)."""
        p = self.command(name, help, description=description)
        return Commands(p, dest=dest, title=f"{name} commands")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions and epilogs as written (they hold example command lines)."""

    def __init__(self, prog, indent_increment=2, max_help_position=34, width=None):
        super().__init__(prog, indent_increment, max_help_position, width)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def complete(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Runs every pending setup in the tree, so every flag of every command exists (docs, tests)."""
    _run_pending(parser)
    for sub in subcommands(parser):
        _run_pending(sub)
        complete(sub)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]


def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Yields (command path, parser) for every subcommand, depth first, in declaration order (runs setups)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _run_pending(sub)
                yield (*prefix, name), sub
                yield from walk(sub, (*prefix, name))
