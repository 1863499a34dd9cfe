"""`mimo-epd router`: an LLM router in front of LLM workers (mimo_epd/router/llm.py; docs/routing.md)."""

from __future__ import annotations


def _setup(p) -> None:
    from mimo_epd.router.llm import add_arguments

    add_arguments(p)


def _run(args) -> int:
    from mimo_epd.router.llm import main

    return main(args)


EPILOG = """\
examples:
  mimo-epd router --port 7000 --workers 127.0.0.1:50061,127.0.0.1:50062
  mimo-epd router --port 7000 --router-state redis://127.0.0.1:6379/0     workers and encoders from the registry

Prints `ready HOST:PORT` on stdout once serving; logs go to stderr."""


def register(commands) -> None:
    commands.command(
        "router",
        "an LLM router: KV-affinity routing over LLM workers, state in memory or Redis",
        setup=_setup,
        run=_run,
        epilog=EPILOG,
    )
