"""A simulator of the LLM engine on a virtual clock: the real Scheduler, SWARadixCache, SlotPool and RequestKV
driven by a simulated runner whose step times come from a cost model (docs/simulator.md).

- `shapes.py`: model shapes (tiny, MiMo-V2-Flash, MiMo-V2.5-Pro) as parameter / FLOP / KV-byte facts;
- `cost.py`: step features and device profiles (`cpu-measured` fitted, `h200` roofline);
- `runner.py`: `SimRunner.execute(segments)`, the model runner's stand-in;
- `engine.py`: `SimWorker`, one worker on a virtual clock, and `simulate` (a single-worker loop);
- `trace.py`: simulated requests and the long-context mix;
- `calibrate.py`: timed steps of the real tiny model, the `cpu-measured` fit and the live-vs-sim validation.
"""

from .cost import CostModel, LinearProfile, RooflineProfile, load_profile, step_features
from .engine import Finished, SimWorker, WorkerConfig, simulate
from .runner import SimRunner
from .shapes import SHAPES, ModelShape, get_shape
from .trace import SimRequest, length_class, long_context_mix

__all__ = [
    "CostModel",
    "LinearProfile",
    "RooflineProfile",
    "load_profile",
    "step_features",
    "Finished",
    "SimWorker",
    "WorkerConfig",
    "simulate",
    "SimRunner",
    "SHAPES",
    "ModelShape",
    "get_shape",
    "SimRequest",
    "length_class",
    "long_context_mix",
]
