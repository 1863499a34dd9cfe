"""Chat templates render exactly as transformers' `apply_chat_template` does (the same template, the same
messages, both ways), including whitespace control, raise_exception, namespaces, loop controls and tojson."""

from __future__ import annotations

import json

import pytest

from llm_backend.server.chat_template import TINY_TEMPLATE, ChatTemplate, ChatTemplateError, load_chat_template

# ChatML-like, with the features real checkpoint templates use.
CHATML = """{%- set ns = namespace(system=false) -%}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unsupported role ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] == 'system' %}{% set ns.system = true %}{% endif %}
    {{ bos_token if loop.first else '' }}<|im_start|>{{ message['role'] }}
    {% if message['content'] is string %}
{{ message['content'] | trim }}
    {% else %}
        {% for part in message['content'] %}
            {% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}
            {% if loop.index > 8 %}{% break %}{% endif %}
        {% endfor %}
    {% endif %}
<|im_end|>
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}
{% if not ns.system %}(no system prompt){% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "  You are terse. «ünïcode» 日本  "},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": 'And <this>? "quoted" & more'},
]


def hf_tokenizer(template: str, bos: str = "<s>", eos: str = "</s>"):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]")),
        bos_token=bos,
        eos_token=eos,
        unk_token="[UNK]",
    )
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [CHATML, TINY_TEMPLATE], ids=["chatml", "tiny"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(template, add_generation_prompt):
    ref = hf_tokenizer(template).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"}).render(
        MESSAGES, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref
    assert ours.endswith(("<|im_start|>assistant\n", "<|assistant|>\n")) == add_generation_prompt


def test_tools_tojson_is_not_html_escaped():
    tools = [{"type": "function", "function": {"name": "f<x>", "description": "a & b, «c»"}}]
    ref = hf_tokenizer(CHATML).apply_chat_template(MESSAGES[:2], tools=tools, tokenize=False)
    ours = ChatTemplate(CHATML, {"bos_token": "<s>"}).render(MESSAGES[:2], add_generation_prompt=False, tools=tools)
    assert ours == ref and json.dumps(tools, ensure_ascii=False) in ours


def test_raise_exception_becomes_a_template_error():
    with pytest.raises(ChatTemplateError, match="unsupported role tool"):
        ChatTemplate(CHATML).render([{"role": "tool", "content": "x"}])


def test_a_template_that_does_not_parse_fails_at_load():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")


def test_sandboxed():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil).render(MESSAGES)


def test_tiny_random_template_documented_shape():
    text = load_chat_template("tiny-random").render(
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    )
    assert text == "<|system|>\nYou are helpful.\n<|user|>\nHi\n<|assistant|>\n"


def test_checkpoint_template_and_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": "x"}],
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
            }
        )
    )
    tpl = load_chat_template(str(tmp_path))
    ref = hf_tokenizer(CHATML).apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tpl.render(MESSAGES) == ref and tpl.render(MESSAGES).lstrip().startswith("<s><|im_start|>system")
    (tmp_path / "chat_template.jinja").write_text(TINY_TEMPLATE)  # the newer file wins over the json field
    assert load_chat_template(str(tmp_path)).source == TINY_TEMPLATE
    override = tmp_path / "mine.jinja"
    override.write_text("{{ messages | length }}")
    assert load_chat_template(str(tmp_path), str(override)).render(MESSAGES) == "4"
