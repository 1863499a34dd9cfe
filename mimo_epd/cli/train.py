"""`mimo-epd train-tiny`: trains the shipped tiny model from the Python documentation (mimo_epd/train)."""

from __future__ import annotations


def setup(parser) -> None:
    from ..common import flags
    from ..train.trainer import TrainConfig

    flags.add_arguments(parser, TrainConfig)


def run(args) -> int:
    import json

    from ..common import flags
    from ..train.trainer import TrainConfig, train
    from .common import error

    cfg = flags.from_args(TrainConfig, args)
    try:
        cfg.validate()
        result = train(cfg)
    except (ValueError, FileNotFoundError) as e:
        return error(str(e))
    print(json.dumps(result), flush=True)
    return 0


def register(commands) -> None:
    commands.command(
        "train-tiny",
        "train the tiny default model (with its MTP layers) on the Python documentation; prints one JSON",
        setup=setup,
        run=run,
    )
