"""The LLM engine, one idea per module:

- `interfaces.py`: the seams features plug into (Constraint, Drafter, KVLoader, SchedulerRole, Ticket,
  TransferPort) and `RequestStats`, what the engine reports about a request;
- `request.py`: SamplingParams, Request, RequestOutput (what a request is);
- `scheduler.py`: admission, length buckets, priority, chunking, preemption, KV bookkeeping (what runs next);
- `runner.py`: one forward over a step's segments + sampling (`sampler.py`), behind `execute(segments)`;
- `speculative.py` + `spec_control.py`: MTP speculative decoding (a `Drafter` and its runner);
- `llm.py`: `LLM`, the builder of its parts, the offline API (`generate`) and the serving loop (`run_forever`).
"""

from ..tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from .llm import LLM, OverloadedError
from .request import MEDIA_NEEDED, PromptTooLong, Request, RequestOutput, SamplingParams, Usage
from .runner import ModelRunner, Runner
from .scheduler import Scheduler, Segment, SegmentResult

__all__ = [
    "LLM",
    "MEDIA_NEEDED",
    "OverloadedError",
    "PromptTooLong",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Usage",
    "ModelRunner",
    "Runner",
    "Scheduler",
    "Segment",
    "SegmentResult",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
]
