"""The prompt rules the LLM worker and the router's HTTP front share (torch-free, so the router imports it
without the engine).

The router predicts which worker holds a request's prompt in its prefix cache by computing the prompt token
ids itself; that prediction is only right while it computes them exactly as the worker does. Everything that
decides those ids lives here, once:

- `normalize_messages`: chat `messages` as the chat template sees them. Roles system / developer (as system)
  / user / assistant; content a string or a list of `text`, `image_url`, `video_url` and `audio_url` parts (a
  part's URL is `{"url": ...}` or a bare string) and `input_audio` parts (`{"data": base64, "format": "wav" |
  "mp3" | ...}`, OpenAI's shape); an assistant message with no content is an empty string. Media parts become
  `{"type": "image" | "video" | "audio"}` for the template and are returned separately with the field path
  that names them, in order. With `audio_in_video` (`use_audio_in_video`, Qwen2.5-Omni's per-request flag)
  every video part is followed by an audio part for its soundtrack: one more `{"type": "audio"}` for the
  template and one more `MediaRef` of kind "audio", with the same URL, `track_of` the video's field.
- `audio_in_video(body)`: that flag, read from the body's `use_audio_in_video` or, vLLM's way for
  Qwen2.5-Omni, `mm_processor_kwargs.use_audio_in_video` (a boolean; the two must not disagree).
- `media_url`: the URL schemes a media item may use (http, https, data).
- `encode_text`: text to ids with the engine tokenizer; with special tokens (BOS) for a raw prompt, without
  for text a chat template rendered with its own (as transformers tokenizes `apply_chat_template` output).
- `is_token_ids`: what a prompt of token ids is (a non-empty array of integers in [0, 2^63)).
- `MAX_TOP_LOGPROBS`: the most alternatives per position a request may ask for.

Invariant: every rule raises `RuleError` (a `ValueError` naming the offending field in `param`) and nothing
else, whatever JSON value it is given; the worker turns it into a 400, the router into "route by load".
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MEDIA_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}  # URL parts: part type -> kind
# The `format` values of OpenAI's `input_audio`, and the other containers the encoder decodes; raw pcm16 has
# no header to read its rate from.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm")
MEDIA_SCHEMES = ("http", "https", "data")
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_ID = (1 << 63) - 1  # a client's token id fits an int64 (the worker then checks it against the vocabulary)


class RuleError(ValueError):
    """A request field breaks a prompt rule: `param` names it (e.g. `messages[2].content[0].type`)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"'{param}': {message}")
        self.param, self.message = param, message


def type_name(v) -> str:
    """A JSON value's type as an error message says it."""
    return {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(v), type(v).__name__)


@dataclass(frozen=True)
class MediaRef:
    """A media part of a chat message: `kind` "image" | "video" | "audio", its URL (or, for `input_audio`, its
    bytes in `data`) and the field that holds it."""

    kind: str
    url: str
    param: str
    data: bytes | None = None
    track_of: str = ""  # an audio track: the field of the video it is the soundtrack of


def audio_in_video(body) -> bool:
    """The request's `use_audio_in_video` flag (default false); raises RuleError naming a bad value."""
    if not isinstance(body, dict):
        return False
    found: list[tuple[str, bool]] = []
    if "use_audio_in_video" in body:
        found.append(("use_audio_in_video", body["use_audio_in_video"]))
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RuleError("mm_processor_kwargs", f"expected an object, got {type_name(kwargs)}")
    if kwargs and "use_audio_in_video" in kwargs:
        found.append(("mm_processor_kwargs.use_audio_in_video", kwargs["use_audio_in_video"]))
    for param, v in found:
        if not isinstance(v, bool):
            raise RuleError(param, f"expected a boolean, got {type_name(v)}")
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise RuleError("mm_processor_kwargs.use_audio_in_video", "disagrees with use_audio_in_video")
    return bool(found and found[0][1])


def media_url(url, param: str) -> str:
    """The URL of a media item, checked: a non-empty string with an accepted scheme."""
    if not isinstance(url, str) or not url:
        raise RuleError(param, "expected a URL string")
    scheme = url.split(":", 1)[0].lower()
    if scheme not in MEDIA_SCHEMES:
        raise RuleError(param, f"only http(s):// and data: URLs are accepted, got {scheme[:32]!r}")
    return url


def _part(part, pp: str, media: list[MediaRef], audio_in_video: bool) -> list[dict]:
    if not isinstance(part, dict):
        raise RuleError(pp, f"expected an object, got {type_name(part)}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RuleError(f"{pp}.text", "expected a string")
        return [{"type": "text", "text": part["text"]}]
    if isinstance(kind, str) and kind in MEDIA_PARTS:
        ref = part.get(kind)
        url = ref.get("url") if isinstance(ref, dict) else ref
        param = f"{pp}.{kind}.url"
        media.append(MediaRef(MEDIA_PARTS[kind], media_url(url, param), param))
        if kind == "video_url" and audio_in_video:  # its soundtrack follows it
            media.append(MediaRef("audio", media[-1].url, param, track_of=param))
            return [{"type": "video"}, {"type": "audio"}]
        return [{"type": MEDIA_PARTS[kind]}]
    if kind == "input_audio":
        media.append(_input_audio(part.get("input_audio"), f"{pp}.input_audio"))
        return [{"type": "audio"}]
    shown = repr(kind[:64]) if isinstance(kind, str) else type_name(kind)
    raise RuleError(f"{pp}.type", f"unsupported content part {shown} (text, {', '.join(MEDIA_PARTS)}, input_audio)")


def _input_audio(ref, param: str) -> MediaRef:
    if not isinstance(ref, dict):
        raise RuleError(param, f"expected an object with data and format, got {type_name(ref)}")
    fmt, data = ref.get("format"), ref.get("data")
    if not isinstance(fmt, str) or fmt not in AUDIO_FORMATS:
        shown = repr(fmt[:32]) if isinstance(fmt, str) else type_name(fmt)
        raise RuleError(f"{param}.format", f"unsupported audio format {shown} (one of {', '.join(AUDIO_FORMATS)})")
    if not isinstance(data, str) or not data:
        raise RuleError(f"{param}.data", "expected base64-encoded audio bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RuleError(f"{param}.data", "is not valid base64") from None
    return MediaRef("audio", "", f"{param}.data", raw)


def _plain(message: dict, role: str, param: str, content) -> dict:
    return {"role": role, "content": content}


def normalize_messages(
    messages, roles: dict[str, str] = ROLES, build=_plain, audio_in_video: bool = False
) -> tuple[list[dict], list[MediaRef]]:
    """(the messages as the chat template sees them, their media parts in order); raises RuleError.

    `roles` maps the accepted roles to the template's; `build(message, role, param, content)` makes one
    template message from the checked role and content (a seam for fields beside them, e.g. tool calls; it may
    raise its own ValueError naming the field). `audio_in_video`: each video part brings its soundtrack as an
    audio part right after it. Worker and router must pass the same three."""
    if messages is None:
        raise RuleError("messages", "is required")
    if not isinstance(messages, list):
        raise RuleError("messages", f"expected an array, got {type_name(messages)}")
    if not messages:
        raise RuleError("messages", "must not be empty")
    out: list[dict] = []
    media: list[MediaRef] = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RuleError(p, f"expected an object, got {type_name(m)}")
        role = m.get("role")
        if not isinstance(role, str) or role not in roles:
            shown = repr(role[:64]) if isinstance(role, str) else type_name(role)
            raise RuleError(f"{p}.role", f"unsupported role {shown} ({', '.join(roles)})")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            out.append(build(m, roles[role], p, content))
            continue
        if not isinstance(content, list):
            raise RuleError(f"{p}.content", f"expected a string or an array of parts, got {type_name(content)}")
        parts = [q for j, part in enumerate(content) for q in _part(part, f"{p}.content[{j}]", media, audio_in_video)]
        out.append(build(m, roles[role], p, parts))
    return out, media


def is_token_ids(p) -> bool:
    """Whether `p` is a prompt of token ids: a non-empty array of integers in [0, 2^63)."""
    return (
        isinstance(p, list)
        and bool(p)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in p)
    )


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The engine tokenizer's ids for `text` (BOS first where it has one); without special tokens for text that a
    chat template rendered with its own. The byte tokenizer (no inner `tok`) has no BOS text in its template:
    BOS always."""
    inner = getattr(tokenizer, "tok", None)  # a checkpoint's tokenizers.Tokenizer
    if add_special_tokens or inner is None:
        return list(tokenizer.encode(text))
    return list(inner.encode(text, add_special_tokens=False).ids)
