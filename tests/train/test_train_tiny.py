"""`mimo-epd train-tiny` on a small corpus written here (no Debian package needed): the HTML extraction rules, a
short run that lowers the held-out loss, the same flags giving the same checkpoint, and a run stopped and resumed
giving the checkpoint of an uninterrupted one. The checkpoint it writes loads through the ordinary path."""

from __future__ import annotations

import json

import pytest

from llm_backend.models import MiMoV2FlashForCausalLM, load_llm
from mimo_epd.train import corpus
from mimo_epd.train.trainer import Data, TrainConfig, evaluate, init_weights, model_config, train

PAGE = """<html><body><div class="sphinxsidebar"><h3>Navigation</h3><p>skip me</p></div>
<div class="body" role="main"><section id="m"><h1>{name} — {title}<a class="headerlink" href="#m">¶</a></h1>
<p>The <code>{name}</code> module   helps with
{title}. It is small.</p>
<div class="highlight"><pre><span class="gp">&gt;&gt;&gt; </span>import {name}
<span class="gp">&gt;&gt;&gt; </span>{name}.run(1)
2
</pre></div>
<section id="api"><h2>Functions<a class="headerlink" href="#api">¶</a></h2>
<dl><dt>{name}.run(x)</dt><dd><p>Return x plus one. {filler}</p></dd></dl>
<table><tr><th>name</th><th>value</th></tr><tr><td>one</td><td>1</td></tr></table>
</section></section></div></body></html>"""
WORDS = "the value of a list is returned when the function is called with a number and a string".split()


def write_corpus(root, pages: int = 24):
    lib = root / "library"
    lib.mkdir(parents=True)
    for i in range(pages):
        filler = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(60))
        html = PAGE.format(name=f"mod{i}", title=f"tools for task {i}", filler=filler)
        (lib / f"mod{i}.html").write_text(html, encoding="utf-8")
    (root / "genindex.html").write_text(PAGE.format(name="index", title="x", filler=""), encoding="utf-8")
    return root


def test_extraction_keeps_the_body_its_sections_code_and_tables(tmp_path):
    pages = corpus.extract(write_corpus(tmp_path / "html", pages=2))
    assert [p.path for p in pages] == ["library/mod0", "library/mod1"]  # the index page is skipped
    p = pages[0]
    assert p.title == "mod0 — tools for task 0"
    assert [s.heading for s in p.sections] == ["mod0 — tools for task 0", "Functions"]
    assert p.sections[0].blocks == [
        "The mod0 module helps with tools for task 0. It is small.",
        ">>> import mod0\n>>> mod0.run(1)\n2",
    ]
    assert p.sections[1].blocks == [
        "mod0.run(x)",
        "Return x plus one. " + " ".join(WORDS[j % len(WORDS)] for j in range(60)),
        "name | value",
        "one | 1",
    ]
    assert "skip me" not in json.dumps([s.blocks for s in p.sections])
    again = corpus.extract(tmp_path / "html")
    assert [(q.path, [s.blocks for s in q.sections]) for q in again] == [
        (q.path, [s.blocks for s in q.sections]) for q in pages
    ]


def test_the_split_depends_on_the_page_alone():
    pages = [corpus.Page(f"library/p{i}", "t", []) for i in range(400)]
    train, held = corpus.split(pages, 30)
    assert 0 < len(held) < 30 and len(train) + len(held) == 400
    _, held_reversed = corpus.split(pages[::-1], 30)
    assert sorted(p.path for p in held_reversed) == sorted(p.path for p in held)


def _config(root, out, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        corpus_root=str(root),
        heldout_per_mille=250,
        vocab_size=384,
        hidden_size=64,
        layers=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        experts=4,
        seq_len=48,
        batch=4,
        steps=12,
        warmup=2,
        lr=5e-3,
        checkpoint_every=5,
        eval_rows=8,
        log_every=4,
        threads=1,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "html")


def test_a_short_run_lowers_the_heldout_loss_and_writes_a_loadable_checkpoint(html, tmp_path):
    tc = _config(html, tmp_path / "ck")
    data = Data(tc)
    untrained = MiMoV2FlashForCausalLM(model_config(tc, data.tokenizer.get_vocab_size()))
    init_weights(untrained, tc.seed)
    before = evaluate(untrained.eval(), data.heldout, tc.mtp_layers, tc.batch)
    result = train(tc)
    assert result["heldout_loss"] < before["heldout_loss"] - 1.0, (before, result)
    assert result["tokens_trained"] == 12 * 4 * 48 and len(result["mtp_top1_accuracy"]) == 3
    model = load_llm(str(tmp_path / "ck"))
    assert model.config.num_nextn_predict_layers == 3 and len(model.model.mtp.layers) == 3
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["model_type"] == "mimo_v2_flash" and cfg["vision_config"]["out_hidden_size"] == 64
    # A second stage starts from this checkpoint (other samples and mix); another vocabulary is refused.
    stage2 = train(_config(html, tmp_path / "ck2", init_from=str(tmp_path / "ck"), steps=3, seed=1, mix="qa=1,hello=1"))
    assert stage2["heldout_loss"] < before["heldout_loss"] - 1.0
    with pytest.raises(ValueError, match="tokenizer"):
        train(_config(html, tmp_path / "ck3", init_from=str(tmp_path / "ck"), vocab_size=300))


def test_the_same_flags_give_the_same_checkpoint_and_a_resumed_run_equals_an_uninterrupted_one(html, tmp_path):
    a = train(_config(html, tmp_path / "a", steps=6))
    stopped = train(_config(html, tmp_path / "b", steps=6, stop_after=3))
    assert stopped["stopped_at_step"] == 3 and not (tmp_path / "b" / "model.safetensors").exists()
    b = train(_config(html, tmp_path / "b", steps=6))
    assert a["heldout_loss"] == b["heldout_loss"] and a["mtp_top1_accuracy"] == b["mtp_top1_accuracy"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="other flags"):
        train(_config(html, tmp_path / "b", steps=7, work_dir=str(tmp_path / "b.work")))


def test_the_sample_mix_follows_plain_share_and_chats_per_section(html):
    from llm_backend.server.chat_template import ChatTemplate
    from mimo_epd.train.samples import build_samples
    from mimo_epd.train.tokenizer import BOS, CHAT_TEMPLATE, IM_END

    pages = corpus.extract(html)
    render = ChatTemplate(CHAT_TEMPLATE, {"bos_token": BOS, "eos_token": IM_END}).render
    sections = sum(len(p.sections) for p in pages)

    def count(**kw):
        texts = build_samples(pages, render, seed=0, epoch=0, mix={"hello": 1.0}, **kw)
        chats = sum("<|im_start|>" in t for t in texts)
        return len(texts) - chats, chats

    assert count(plain_share=1.0, chats=1) == (sections, sections)
    assert count(plain_share=0.0, chats=3) == (0, 3 * sections)
    plain, chats = count(plain_share=0.5, chats=2)
    assert 0 < plain < sections and chats == 2 * sections
    assert build_samples(pages, render, 0, 0, plain_share=0.5, chats=2) == build_samples(
        pages, render, 0, 0, plain_share=0.5, chats=2
    )
    with pytest.raises(ValueError, match="--plain-share"):
        TrainConfig(out="x", plain_share=1.5).validate()


def test_bad_flags_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--out"):
        TrainConfig().validate()
    with pytest.raises(ValueError, match="--batch"):
        TrainConfig(out="x", batch=0).validate()
    with pytest.raises(ValueError, match="--mix: unknown kind 'poem'"):
        TrainConfig(out="x", mix="qa=1,poem=2").validate()
    with pytest.raises(FileNotFoundError, match="python3.11-doc"):
        Data(TrainConfig(out="x", corpus_root=str(tmp_path / "none")))
