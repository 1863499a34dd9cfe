"""`mimo-epd loadtest <target>`: headless Locust load tests of the gRPC and HTTP APIs (loadtest/)."""

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


def _generate_flags(p) -> None:
    from loadtest import generate

    generate.add_arguments(p)


def _run_generate(args) -> int:
    from loadtest import generate

    return generate.run(args)


def register(commands) -> None:
    lt = commands.group(
        "loadtest", "headless Locust load tests: the encoder over gRPC, generation over HTTP and gRPC", dest="loadtest"
    )
    lt.command(
        "encoder",
        "Locust against an encoder or `serve`: QPS, P50/P90/P99, failures by status (JSON)",
        setup=_encoder_flags,
        run=_run_encoder,
        epilog="example:\n  mimo-epd loadtest encoder --server 127.0.0.1:50051 --run-time 30s",
    )
    lt.command(
        "generate",
        "Locust generation load: streamed chat over HTTP and Generate over gRPC; QPS, TTFT and "
        "end-to-end P50/P90/P99, tokens/s, failures by status (JSON)",
        setup=_generate_flags,
        run=_run_generate,
        epilog="example:\n  mimo-epd loadtest generate --http http://127.0.0.1:8000 --grpc 127.0.0.1:50051 "
        "--run-time 30s",
    )
    commands.command(
        "chaos",
        "fault campaign: SIGKILL node processes under Locust load; per-fault loss and recovery, RSS soak (JSON)",
        setup=_chaos_flags,
        run=_run_chaos,
        epilog="example:\n  mimo-epd chaos --duration-s 120 --soak-s 600 --faults encoder,decode_worker,llm,router",
    )
