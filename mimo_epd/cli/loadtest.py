"""`mimo-epd loadtest <target>`: headless Locust load tests of the gRPC API (loadtest/)."""
from __future__ import annotations


def _encoder_flags(p) -> None:
    from loadtest import run

    run.add_arguments(p)


def _run_encoder(args) -> int:
    from loadtest import run

    return run.run(args)


def _chaos_flags(p) -> None:
    from loadtest import chaos

    chaos.add_arguments(p)


def _run_chaos(args) -> int:
    from loadtest import chaos

    return chaos.run(args)


def register(commands) -> None:
    lt = commands.group("loadtest", "headless Locust load tests of the gRPC API", dest="loadtest")
    lt.command("encoder", "Locust against an encoder or `serve`: QPS, P50/P90/P99, failures by status (JSON)",
               setup=_encoder_flags, run=_run_encoder,
               epilog="example:\n  mimo-epd loadtest encoder --server 127.0.0.1:50051 --run-time 30s")
    commands.command("chaos", "fault campaign: SIGKILL node processes under Locust load; per-fault loss and recovery, "
                     "RSS soak (JSON)", setup=_chaos_flags, run=_run_chaos,
                     epilog="example:\n  mimo-epd chaos --duration-s 120 --soak-s 600 --faults encoder,decode_worker,llm,router")
