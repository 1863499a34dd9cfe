"""`serve MODEL`'s start-up plan (mimo_epd/common/checkpoint.py) on checkpoints saved by transformers: which parts a
checkpoint brings, and every mismatch refused before any process starts with one line naming the file."""

import json
import shutil

import pytest

from mimo_epd.common.checkpoint import (
    BYTES,
    CheckpointError,
    check_safetensors,
    check_worker,
    inspect_checkpoint,
    plan_node,
)
from mimo_epd.data import TINY_MODEL

pytest.importorskip("transformers")
from tests.cli.checkpoints import mimo_checkpoint, qwen_vl_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "text": mimo_checkpoint(root / "text"),
        "vision": mimo_checkpoint(root / "vision", vision_width=64),
        "notok": mimo_checkpoint(root / "notok", tokenizer=False),
        "w128": mimo_checkpoint(root / "w128", hidden=128),
        "qwen": qwen_vl_checkpoint(root / "qwen", width=64),
    }


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_multimodal_checkpoint_brings_its_tower_and_its_llm(ckpts):
    plan = plan_node(str(ckpts["vision"]))
    assert plan.llm.directory == plan.vision.directory == str(ckpts["vision"])
    assert plan.vision.vision_width == plan.llm.llm_hidden_size == 64 and plan.llm.max_position_embeddings == 4096
    assert plan.tokenizer == str(ckpts["vision"] / "tokenizer.json") and not plan.notices
    tiny = plan_node("tiny")  # the shipped model is laid out the same way
    assert tiny.vision.directory == tiny.llm.directory == TINY_MODEL and tiny.vision.vision_width == 256


def test_a_text_only_checkpoint_serves_text_and_says_media_is_unavailable(ckpts):
    plan = plan_node(str(ckpts["text"]))
    assert plan.vision is None and plan.llm.has_llm
    assert "no vision_config" in plan.notices[0] and "media" in plan.notices[0]
    # a separate tower stays possible
    assert plan_node(str(ckpts["text"]), encoder_model=str(ckpts["qwen"])).vision.model_type == "qwen2_5_vl"


def test_tower_and_llm_widths_are_checked_at_start(ckpts):
    with pytest.raises(CheckpointError) as e:
        plan_node("tiny", llm_model=str(ckpts["w128"]))
    msg = one_line(e)
    assert "output width 256" in msg and "hidden size 128" in msg
    assert f"{TINY_MODEL}/config.json" in msg and f"{ckpts['w128']}/config.json" in msg


def test_every_model_path_is_checked_before_anything_starts(ckpts, tmp_path):
    with pytest.raises(CheckpointError) as e:
        plan_node("tiny", llm_model="/nonexistent")
    assert one_line(e).startswith("/nonexistent: no such checkpoint directory")
    with pytest.raises(CheckpointError) as e:
        plan_node(str(ckpts["qwen"]))  # a Qwen2.5-VL LLM is not one the workers load
    assert "model_type 'qwen2_5_vl' is not an LLM the workers serve" in one_line(e)
    assert plan_node(str(ckpts["qwen"]), llm=False).vision.vision_width == 64
    with pytest.raises(CheckpointError) as e:
        plan_node(str(ckpts["text"]), encoder_model=str(ckpts["w128"]))
    assert "has no vision tower (--encoder-model)" in one_line(e)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(str(bad))
    assert one_line(e).startswith(f"{bad}/config.json: not a JSON config")


def test_no_tokenizer_is_an_error_naming_the_file_unless_bytes_are_asked_for(ckpts, tmp_path):
    with pytest.raises(CheckpointError) as e:
        plan_node(str(ckpts["notok"]))
    assert one_line(e).startswith(f"{ckpts['notok']}/tokenizer.json: missing") and "--tokenizer bytes" in str(e.value)
    assert plan_node(str(ckpts["notok"]), tokenizer=BYTES).tokenizer == BYTES
    assert plan_node(str(ckpts["notok"]), tokenizer=TINY_MODEL).tokenizer == f"{TINY_MODEL}/tokenizer.json"
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": "1.0"}')
    with pytest.raises(CheckpointError) as e:
        check_worker(str(ckpts["notok"]), str(broken))
    assert one_line(e).startswith(f"{broken}: not a tokenizer that loads")


def test_a_truncated_safetensors_file_is_named(ckpts, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(ckpts["text"], d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(str(d))
    assert one_line(e).startswith(f"{f}: truncated: its tensors need {len(data)} bytes")
    f.write_bytes(data[:20])  # the header itself cut
    with pytest.raises(CheckpointError) as e:
        check_safetensors(str(f))
    assert "truncated: its header claims" in one_line(e)


def test_max_model_len_beyond_the_models_context_is_refused(ckpts):
    assert plan_node(str(ckpts["text"]), max_model_len=2048).max_model_len == 2048
    with pytest.raises(CheckpointError) as e:
        plan_node(str(ckpts["text"]), max_model_len=8192)
    assert "--max-model-len 8192 exceeds the model's max_position_embeddings 4096" in one_line(e)


def test_a_shape_mismatch_names_the_checkpoint(ckpts, tmp_path):
    from llm_backend.models import load_llm

    d = tmp_path / "shape"
    shutil.copytree(ckpts["text"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_llm(str(d))
    assert (
        one_line(e)
        == f"{d}/model.safetensors: tensor model.layers.0.mlp.down_proj.weight: shape [64, 96], config.json gives [64, 100]"
    )
