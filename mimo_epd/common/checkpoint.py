"""What a model argument names, read from its files before any process starts.

A checkpoint directory is laid out as transformers saves it: one `config.json` whose `model_type` names the
architecture and, for a multimodal model, a `vision_config` (and `audio_config`) sub-config beside the LLM's own
fields (MiMo-V2.5 and Qwen2.5-VL are laid out so); `*.safetensors` weights (or a `model.safetensors.index.json`
naming the shards); `tokenizer.json`.

- `inspect_checkpoint(name)` reads `config.json` and each safetensors file's header (never the tensors) and
  returns a `Checkpoint`: which parts it holds (an LLM the workers serve, a vision tower, an audio tower the
  encoders run beside it),
  their widths, the context it was trained for (`max_position_embeddings`), its tokenizer file.
- `plan_node(...)` combines `serve`'s one model argument with the per-part overrides into the `NodePlan` the node
  starts from, and refuses what could only fail later, per request: a tower whose output width is not the LLM's
  hidden size, an LLM checkpoint the workers cannot load, a tokenizer that does not load, a context longer than the
  model's.

Invariants: every failure is a `CheckpointError` whose message is one line naming the file and the reason; a
byte tokenizer is used only for `tiny-random` or when asked (`--tokenizer bytes`); nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from mimo_epd.common.model_names import TINY, TINY_RANDOM, resolve_model

# The LLM architectures the workers load, and the vision towers the encoders run.
LLM_TYPES = ("mimo_v2_flash", "mimo_v2")
VISION_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision", "mimovl")  # the last two: vision-only checkpoints
BYTES = "bytes"  # --tokenizer bytes: one token per UTF-8 byte
# `tiny-random`'s widths (llm_backend.models.TINY_LLM_CONFIG, encoder_server.models.TINY_VISION_CONFIG)
TINY_RANDOM_WIDTH = 256


class CheckpointError(ValueError):
    """A model argument that cannot be served; the message is one line naming the file and the reason."""


@dataclass(frozen=True)
class Checkpoint:
    """One model argument, inspected. `directory` is empty for `tiny-random` (no files)."""

    name: str
    directory: str
    model_type: str
    llm_hidden_size: int | None  # set when the workers can serve it (model_type in LLM_TYPES)
    vision_width: int | None  # the vision tower's output width, when it has one
    audio_width: int | None  # the audio tower's output width, when it declares one (`audio_config`)
    max_position_embeddings: int | None
    tokenizer_file: str  # its tokenizer.json, or "" when it has none
    unsupported_vision: str = ""  # the vision_config's model_type when it is a tower the encoders do not run
    unsupported_audio: str = ""  # the audio_config's model_type when it is a tower the encoders do not run

    @property
    def config_file(self) -> str:
        return os.path.join(self.directory, "config.json") if self.directory else self.name

    @property
    def has_llm(self) -> bool:
        return self.llm_hidden_size is not None

    @property
    def has_vision(self) -> bool:
        return self.vision_width is not None


def _fail(path: str, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: {reason}")


def _read_config(directory: str, name: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise _fail(directory, f"no such checkpoint directory (model {name!r}; names: {TINY!r}, {TINY_RANDOM!r})")
    if not os.path.isfile(path):
        raise _fail(path, "missing: a checkpoint directory holds a transformers config.json")
    try:
        cfg = json.loads(open(path, encoding="utf-8").read())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _fail(path, f"not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise _fail(path, "not a JSON object")
    return cfg


def check_safetensors(path: str) -> None:
    """The file's header is whole and its tensors' byte ranges lie inside the file (a file cut short fails here,
    before any process loads it)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            text = f.read(n) if 0 <= n <= size - 8 else b""
    except OSError as e:
        raise _fail(path, e.strerror or str(e)) from None
    if n < 0:
        raise _fail(path, f"truncated: {size} bytes, not a safetensors file")
    if n > size - 8:
        raise _fail(path, f"truncated: its header claims {n} bytes, the file has {size}")
    try:
        header = json.loads(text)
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise _fail(path, "corrupt safetensors header") from None
    if 8 + n + end > size:
        raise _fail(path, f"truncated: its tensors need {8 + n + end} bytes, the file has {size}")


def _weight_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            names = sorted(set(json.loads(open(index, encoding="utf-8").read())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise _fail(index, f"not a safetensors index ({e})") from None
        for n in names:
            if not os.path.isfile(os.path.join(directory, n)):
                raise _fail(os.path.join(directory, n), f"missing (named by {os.path.basename(index)})")
        return [os.path.join(directory, n) for n in names]
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise _fail(os.path.join(directory, "model.safetensors"), "missing: the checkpoint has no *.safetensors")
    return files


def _int(cfg: dict, key: str) -> int | None:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# vision_config model types of towers the encoders run (absent: a Qwen2.5-VL layout without one)
VISION_SUB_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision", "mimovl", None)
# audio_config kinds the encoders run (Qwen2-Audio's; MiMo's tokenizer + encoder, known by its keys)
AUDIO_SUB_TYPES = ("qwen2_audio_encoder", "mimo_audio", None)


def _vision_width(cfg: dict) -> int | None:
    model_type = cfg.get("model_type", "")
    sub = cfg.get("vision_config")
    if isinstance(sub, dict):
        if sub.get("model_type") not in VISION_SUB_TYPES:
            return None  # a tower the encoders do not run: `unsupported_vision` says so
        return _int(sub, "out_hidden_size") or _int(sub, "hidden_size")
    if model_type in ("qwen2_5_vl_vision", "mimovl"):
        return _int(cfg, "out_hidden_size") or _int(cfg, "hidden_size")
    return None


def _audio_width(cfg: dict) -> int | None:
    """What the encoder's audio tower emits (encoder_server/models/qwen2_audio.py): the projector into the
    checkpoint's own LLM width (`text_config.hidden_size`, or `hidden_size` beside the `audio_config`), else the
    tower's `out_hidden_size` / `d_model`."""
    sub = cfg.get("audio_config")
    if not isinstance(sub, dict) or audio_kind(sub) not in AUDIO_SUB_TYPES:
        return None
    if audio_kind(sub) == "mimo_audio":  # its projection's width
        return _int(sub, "out_hidden_size")
    text = cfg.get("text_config")
    return (
        _int(text if isinstance(text, dict) else cfg, "hidden_size")
        or _int(sub, "out_hidden_size")
        or _int(sub, "d_model")
    )


def inspect_checkpoint(name: str, check_weights: bool = True) -> Checkpoint:
    """`name` (`tiny`, `tiny-random` or a directory) inspected; raises CheckpointError naming the file."""
    if name == TINY_RANDOM:
        return Checkpoint(TINY_RANDOM, "", TINY_RANDOM, TINY_RANDOM_WIDTH, TINY_RANDOM_WIDTH, None, None, "")
    directory = os.path.abspath(resolve_model(name))
    cfg = _read_config(directory, name)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise _fail(os.path.join(directory, "config.json"), "has no model_type")
    sub = cfg.get("text_config")
    text: dict = sub if isinstance(sub, dict) else cfg
    hidden = _int(text, "hidden_size") if model_type in LLM_TYPES else None
    if model_type in LLM_TYPES and hidden is None:
        raise _fail(os.path.join(directory, "config.json"), "has no integer hidden_size")
    vision = _vision_width(cfg)
    if model_type in VISION_TYPES and vision is None:
        raise _fail(os.path.join(directory, "config.json"), f"model_type {model_type!r} without a vision width")
    if check_weights:
        for f in _weight_files(directory):
            check_safetensors(f)
    tok = os.path.join(directory, "tokenizer.json")
    return Checkpoint(
        name=name,
        directory=directory,
        model_type=model_type,
        llm_hidden_size=hidden,
        vision_width=vision,
        audio_width=_audio_width(cfg),
        max_position_embeddings=_int(text, "max_position_embeddings"),
        tokenizer_file=tok if os.path.isfile(tok) else "",
        unsupported_vision=_unsupported_vision(cfg),
        unsupported_audio=_unsupported_audio(cfg),
    )


def audio_kind(sub) -> str | None:
    """An `audio_config`'s tower: its model_type; MiMo's carries none and is known by MiMo-Audio's keys."""
    if not isinstance(sub, dict):
        return None
    if sub.get("model_type") is None and ("speech_vocab_size" in sub or "audio_channels" in sub):
        return "mimo_audio"
    return sub.get("model_type")


def _unsupported_audio(cfg: dict) -> str:
    sub = cfg.get("audio_config")
    if isinstance(sub, dict) and audio_kind(sub) not in AUDIO_SUB_TYPES:
        return str(audio_kind(sub))
    return ""


def _unsupported_vision(cfg: dict) -> str:
    sub = cfg.get("vision_config")
    if isinstance(sub, dict) and sub.get("model_type") not in VISION_SUB_TYPES:
        return str(sub.get("model_type"))
    return ""


def resolve_tokenizer(llm: Checkpoint, tokenizer: str = "") -> str:
    """The tokenizer file the LLM's text goes through: `tokenizer` (a tokenizer.json, or a directory holding one;
    `bytes` for the byte tokenizer), else the checkpoint's own. Loads it once, so a broken one fails here."""
    if tokenizer == BYTES or (not tokenizer and llm.name == TINY_RANDOM):
        return BYTES
    if tokenizer:
        path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
        if not os.path.isfile(path):
            raise _fail(path, "missing (--tokenizer)")
    elif llm.tokenizer_file:
        path = llm.tokenizer_file
    else:
        raise _fail(
            os.path.join(llm.directory, "tokenizer.json"),
            "missing: the checkpoint has no tokenizer (name one with --tokenizer FILE, or --tokenizer bytes for "
            "one token per byte)",
        )
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception subclass for every reason
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _fail(path, f"not a tokenizer that loads ({reason})") from None
    return path


@dataclass(frozen=True)
class NodePlan:
    """What `serve` starts: the LLM workers' checkpoint (None with --no-llm), the encoders' tower (None: media
    unavailable, no encoder process), the tokenizer file (or `bytes`), the context limit (0 = the model's)."""

    llm: Checkpoint | None
    vision: Checkpoint | None
    tokenizer: str
    max_model_len: int
    notices: tuple[str, ...] = ()


def check_llm(lm: Checkpoint | None, flag: str = "--model") -> Checkpoint:
    """`lm` when the LLM workers can load it."""
    assert lm is not None
    if not lm.has_llm:
        raise _fail(
            lm.config_file,
            f"model_type {lm.model_type!r} is not an LLM the workers serve ({', '.join(LLM_TYPES)}); {flag} names "
            "the LLM (a vision-only checkpoint serves with --encoder-model DIR and --no-llm or --llm-model DIR)",
        )
    from llm_backend.models import check_llm_weights

    try:  # every weight's name and shape against config.json, from the headers: before any process starts
        check_llm_weights(lm.directory or lm.name)
    except (ValueError, OSError) as e:
        raise CheckpointError(str(e).splitlines()[0]) from None
    return lm


def check_worker(model: str, tokenizer: str = "", max_model_len: int = 0) -> str:
    """`mimo-epd llm`'s model, tokenizer and context limit checked before it loads anything; returns the
    tokenizer file (or `bytes`)."""
    lm = check_llm(inspect_checkpoint(model))
    check_max_model_len(lm, max_model_len)
    return resolve_tokenizer(lm, tokenizer)


def check_tower(model: str) -> Checkpoint:
    """`mimo-epd encoder`'s model checked before it loads anything: a checkpoint with a vision tower."""
    ckpt = inspect_checkpoint(model)
    if not ckpt.has_vision:
        raise _fail(
            ckpt.config_file,
            f"model_type {ckpt.model_type!r} has no vision tower ({', '.join(VISION_TYPES)}, or a vision_config)",
        )
    return ckpt


def check_max_model_len(llm: Checkpoint, max_model_len: int) -> None:
    limit = llm.max_position_embeddings
    if max_model_len < 0:
        raise CheckpointError(f"--max-model-len must be >= 0 (0 = the model's), got {max_model_len}")
    if limit and max_model_len > limit:
        raise _fail(
            llm.config_file,
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {limit}",
        )


def plan_node(
    model: str,
    encoder_model: str = "",
    llm_model: str = "",
    tokenizer: str = "",
    llm: bool = True,
    max_model_len: int = 0,
) -> NodePlan:
    """`serve MODEL` with its overrides checked against each other; raises CheckpointError (one line)."""
    notices: list[str] = []
    whole = inspect_checkpoint(model) if not (encoder_model and (llm_model or not llm)) else None
    lm: Checkpoint | None = None
    if llm:
        lm = check_llm(inspect_checkpoint(llm_model) if llm_model else whole, "--llm-model" if llm_model else "MODEL")
        check_max_model_len(lm, max_model_len)
    vision = inspect_checkpoint(encoder_model) if encoder_model else whole
    assert vision is not None
    if not vision.has_vision:
        if encoder_model:
            raise _fail(vision.config_file, f"model_type {vision.model_type!r} has no vision tower (--encoder-model)")
        notices.append(
            (
                f"{vision.config_file}: its vision tower ({vision.unsupported_vision}) is not one the encoders run yet: "
                "text only, requests with media are refused"
            )
            if vision.unsupported_vision
            else f"{vision.config_file} has no vision_config: text only, requests with media are refused"
            + (
                " (its audio_config too: the encoders need a vision tower; --encoder-model DIR names one and "
                "--audio-model this checkpoint)"
                if vision.audio_width
                else ""
            )
        )
        vision = None
    if vision is not None and vision.unsupported_audio:
        notices.append(
            f"{vision.config_file}: its audio tower ({vision.unsupported_audio}) is not one the encoders serve yet: "
            "images and video are served, requests with audio are refused"
        )
    if lm is not None and vision is not None and vision.vision_width != lm.llm_hidden_size:
        raise CheckpointError(
            f"the vision tower's output width {vision.vision_width} ({vision.config_file}) != the LLM's hidden size "
            f"{lm.llm_hidden_size} ({lm.config_file}): its image embeddings cannot enter this LLM"
        )
    if lm is not None and vision is not None and vision.audio_width not in (None, lm.llm_hidden_size):
        raise CheckpointError(
            f"the audio tower's output width {vision.audio_width} ({vision.config_file}) != the LLM's hidden size "
            f"{lm.llm_hidden_size} ({lm.config_file}): its audio embeddings cannot enter this LLM"
        )
    tok = resolve_tokenizer(lm, tokenizer) if lm is not None else ""
    return NodePlan(lm, vision, tok, max_model_len, tuple(notices))


def load_weights(model, state: dict, directory) -> tuple[list[str], list[str]]:
    """`model.load_state_dict(state, strict=False)`; a weight whose shape is not config.json's raises a ValueError
    naming the directory and the first such weight (torch's own message spans a line per weight)."""
    try:
        return model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        lines = [x.strip() for x in str(e).splitlines()[1:] if x.strip()]
        first = lines[0] if lines else str(e).strip()
        raise ValueError(
            f"{directory}: the weights do not fit its config.json ({first}; {len(lines)} such weights)"
        ) from None
