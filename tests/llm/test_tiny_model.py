"""The shipped default model (`tiny`, mimo_epd/data/models/tiny): an ordinary checkpoint directory. It loads by
name and by path identically, transformers loads it as `MiMoV2FlashForCausalLM` and decodes greedily exactly as
our engine does, its tokenizer round-trips any UTF-8 text, its chat template renders as transformers'
`apply_chat_template` does, and nothing at run time reads the training corpus or the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backend import LLM, SamplingParams
from llm_backend.models import load_llm
from llm_backend.server.chat_template import load_chat_template
from llm_backend.tokenizer import HFTokenizer, load_tokenizer
from mimo_epd.data import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
SPECIAL_TEXT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a list?"}],
    "multi_turn": [
        {"role": "user", "content": "What is a tuple?"},
        {"role": "assistant", "content": "An immutable sequence."},
        {"role": "user", "content": [{"type": "text", "text": "And a "}, {"type": "text", "text": "list?"}]},
    ],
    "reasoning": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "3 + 3?"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                },
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(TINY_MODEL)


def test_the_shipped_directory_is_a_bf16_checkpoint_under_32_mb_with_mtp_and_vision_weights():
    d = Path(TINY_MODEL)
    assert (d / "model.safetensors").stat().st_size <= 32 * 2**20
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "mimo_v2_flash" and cfg["num_nextn_predict_layers"] == 3
    assert cfg["vision_config"]["out_hidden_size"] == cfg["hidden_size"] == 256
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / name).is_file()
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {f"model.mtp.layers.{i}.eh_proj.weight" for i in range(3)} <= set(dtypes)
    assert {v for k, v in dtypes.items() if k.startswith("visual.")} == {"F32"}  # the seeded tower, exactly
    llm = {v for k, v in dtypes.items() if not k.startswith("visual.") and not k.endswith("e_score_correction_bias")}
    assert llm == {"BF16"}


def test_tiny_by_name_and_by_path_load_identically():
    by_name, by_path = load_llm("tiny"), load_llm(TINY_MODEL)
    a, b = by_name.state_dict(), by_path.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert next(by_name.parameters()).dtype == torch.float32  # bf16 on disk, upcast on load
    assert len(by_name.model.mtp.layers) == 3
    assert load_tokenizer("tiny").tok.to_str() == load_tokenizer(TINY_MODEL).tok.to_str()
    assert load_chat_template("tiny").source == load_chat_template(TINY_MODEL).source
    prompt = load_chat_template("tiny").render(CONVERSATIONS["user"])
    params = SamplingParams(max_tokens=12)
    assert (
        LLM("tiny").generate([prompt], params)[0].output_token_ids
        == LLM(TINY_MODEL).generate([prompt], params)[0].output_token_ids
    )


def hf_tiny(tmp_path):
    """transformers' MiMoV2FlashForCausalLM on the shipped `tiny` files, under its converted config (the release
    keys mapped by hand here, not by our reader): the independent reference of the shipped model."""
    from transformers import AutoModelForCausalLM

    release = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    assert "hybrid_layer_pattern" in release and "layer_types" not in release
    rope = {"rope_type": "default", "partial_rotary_factor": release["partial_rotary_factor"]}
    converted = {k: v for k, v in release.items() if not k.startswith(("swa_", "add_", "hybrid_", "moe_layer"))}
    for k in (
        "sliding_window_size",
        "scoring_func",
        "topk_method",
        "layernorm_epsilon",
        "rope_theta",
        "partial_rotary_factor",
    ):
        converted.pop(k)
    converted.update(
        layer_types=["sliding_attention" if x else "full_attention" for x in release["hybrid_layer_pattern"]],
        mlp_layer_types=["sparse" if x else "dense" for x in release["moe_layer_freq"]],
        sliding_window=release["sliding_window_size"],
        rms_norm_eps=release["layernorm_epsilon"],
        rope_parameters={
            "full_attention": {**rope, "rope_theta": release["rope_theta"]},
            "sliding_attention": {**rope, "rope_theta": release["swa_rope_theta"]},
        },
    )
    assert release["swa_num_key_value_heads"] == 2 * release["num_key_value_heads"]  # transformers' fixed rule
    view = tmp_path / "tiny-converted"
    view.mkdir()
    for f in Path(TINY_MODEL).iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f)
    (view / "config.json").write_text(json.dumps(converted))
    return AutoModelForCausalLM.from_pretrained(str(view), dtype=torch.float32).eval()


def test_transformers_loads_the_shipped_directory_and_decodes_like_the_engine(tmp_path):
    """The shipped config is in the release's layout, as real checkpoints are; transformers reads its converted
    layout, so it gets the same files under the converted config (the release keys mapped by hand here, not by
    our reader), and decodes as the engine does."""
    from transformers import MiMoV2FlashForCausalLM

    hf = hf_tiny(tmp_path)
    assert isinstance(hf, MiMoV2FlashForCausalLM)
    llm = LLM("tiny")
    for messages in (CONVERSATIONS["user"], CONVERSATIONS["system"]):
        ids = llm.tokenizer.encode(load_chat_template("tiny").render(messages))
        ours = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=24, ignore_eos=True))[0]
        with torch.no_grad():
            # BOS is also the pad token: without a mask, generate would mask the BOS position out.
            x = torch.tensor([ids])
            ref = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False, eos_token_id=None
            )
        assert ours.output_token_ids == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, False, True])
def test_the_chat_template_renders_like_transformers(hf_tokenizer, name, thinking):
    kw = {} if thinking is None else {"enable_thinking": thinking}
    tools = TOOLS if name == "tools" else None
    ours = load_chat_template("tiny").render(CONVERSATIONS[name], add_generation_prompt=True, tools=tools, **kw)
    ref = hf_tokenizer.apply_chat_template(
        CONVERSATIONS[name], tools=tools, add_generation_prompt=True, tokenize=False, **kw
    )
    assert ours == ref
    # A generated turn re-renders as the same prefix: the next turn's prompt starts with this one plus the reply.
    if name != "tools":
        again = load_chat_template("tiny").render(
            [*CONVERSATIONS[name], {"role": "assistant", "content": "Yes."}], add_generation_prompt=False, **kw
        )
        assert again.startswith(ours if thinking is not True else ours[: -len("<think>\n")])


def test_the_template_renders_tool_calls_in_the_xml_format():
    text = load_chat_template("tiny").render(CONVERSATIONS["tools"], tools=TOOLS)
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n" in text
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking is off by default


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_the_tokenizer_round_trips_any_utf8_text(text):
    tok = load_tokenizer("tiny")
    assert isinstance(tok, HFTokenizer)
    for special in SPECIAL_TEXT:  # the special tokens' own text is the one thing that does not come back
        text = text.replace(special, "")
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert tok.encode(text)[0] == tok.bos_token_id == 0


def test_thinking_and_tool_call_markers_are_single_tokens_that_decode_as_text():
    tok = load_tokenizer("tiny")
    for i, marker in enumerate(
        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    ):
        assert tok.encode(marker, add_bos=False) == [3 + i]
        assert tok.decode([3 + i]) == marker
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False)) == "user\nhi"


AUDIT = r"""
import sys
events = []
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        events.append(("open", args[0]))
    elif event.startswith(("socket.connect", "socket.getaddrinfo", "urllib.Request")):
        events.append((event, repr(args)[:200]))
sys.addaudithook(hook)
from llm_backend import LLM, SamplingParams
from llm_backend.server.chat_template import load_chat_template
from encoder_server.models import load_vision_model
llm = LLM("tiny")
out = llm.generate([load_chat_template("tiny").render([{"role": "user", "content": "Hello!"}])], SamplingParams(max_tokens=4))
load_vision_model("tiny")
import json
print(json.dumps({"events": events, "train_loaded": any(m.startswith("mimo_epd.train") for m in sys.modules)}))
"""


def test_nothing_at_run_time_reads_the_corpus_or_the_network():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "0"}
    out = subprocess.run([sys.executable, "-c", AUDIT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["train_loaded"]
    opened = [p for kind, p in report["events"] if kind == "open"]
    assert not [p for p in opened if "/usr/share/doc" in p]  # the corpus (the stdlib html package is not)
    assert not [e for e in report["events"] if e[0] != "open"], "network access at run time"
    assert any(p.startswith(TINY_MODEL) for p in opened)  # the shipped files are what it read
