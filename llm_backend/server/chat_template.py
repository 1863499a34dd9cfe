"""Chat templates: a checkpoint's `chat_template` rendered with jinja2 the way transformers'
`apply_chat_template` does, so a conversation becomes the same prompt text here as there.

The environment matches transformers': an immutable sandbox (templates from checkpoints are untrusted
code), `trim_blocks` and `lstrip_blocks`, the loop-controls extension, a `{% generation %}` block tag
(rendered as its body), `tojson` without HTML escaping, and the globals `raise_exception(msg)` and
`strftime_now(fmt)`. The template sees `messages`, `add_generation_prompt`, `tools`, `documents` and the
tokenizer's special tokens (`bos_token`, `eos_token`, ...). A template that raises gives
`ChatTemplateError`, which the API reports as a 400 naming the template's message.

The template comes from `--chat-template FILE` when given, else the checkpoint's `chat_template.jinja`
or the `chat_template` field of its `tokenizer_config.json` (a string, or a list of named templates:
"default" is used), else `TINY_TEMPLATE`. The shipped `tiny` model is a checkpoint with its own template (MiMo's
conventions, docs/model.md); `TINY_TEMPLATE` is `tiny-random`'s and that of a checkpoint without one (docs/api.md):

    <|system|>\\nYou are helpful.\\n<|user|>\\nHi\\n<|assistant|>\\n

one block per message (`<|role|>`, newline, the message's text, newline; text parts of a list content
are concatenated, media parts add nothing: media embeddings go right after BOS), and `<|assistant|>\\n`
when `add_generation_prompt`.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mimo_epd.common.model_names import TINY_RANDOM, resolve_model

TINY_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    pass


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # {"content": "<s>", "lstrip": ...} in tokenizer_config.json
        return v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = ""):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin
        _compile(source)  # fail at start-up, not on the first request

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None, documents=None, **kwargs
    ) -> str:
        try:
            return _compile(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None


def load_chat_template(model: str, override: str = "") -> ChatTemplate:
    """`override` (a file) > the checkpoint's template > TINY_TEMPLATE; special tokens from tokenizer_config.json.
    `tiny` is the shipped checkpoint directory; `tiny-random` has no files (bytes, TINY_TEMPLATE)."""
    cfg = {}
    d = resolve_model(model) if model != TINY_RANDOM else ""
    path = os.path.join(d, "tokenizer_config.json") if d else ""
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(cfg.get(k))) is not None}
    if not d:
        special = {"bos_token": "", "eos_token": ""}  # the byte tokenizer's specials have no text
    if override:
        with open(override, encoding="utf-8") as f:
            return ChatTemplate(f.read(), special, origin=override)
    jinja_file = os.path.join(d, "chat_template.jinja") if d else ""
    if jinja_file and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return ChatTemplate(f.read(), special, origin=jinja_file)
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str) and tpl:
        return ChatTemplate(tpl, special, origin=path)
    return ChatTemplate(TINY_TEMPLATE, special, origin=TINY_RANDOM if not d else "default")
