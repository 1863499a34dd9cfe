"""The incremental detokenizer and the stop-string matcher, on crafted id streams and real tokenizers
(the tiny model's bytes; byte-level BPE and SentencePiece-style BPE trained here with `tokenizers`)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llm_backend.server.detokenizer import IncrementalDetokenizer, StopMatcher
from llm_backend.tokenizer import ByteTokenizer, HFTokenizer

TEXT = "héllo wörld, 日本語のテキスト and emoji 🙂👍🏽 plus plain words again"
CORPUS = [TEXT, "hello world", "the quick brown fox jumps over the lazy dog", "日本語 テキスト", "émoji ünïcödé"] * 20


def stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    out = [detok.push(t) for t in ids]
    out.append(detok.flush())
    return out


def hf(kind: str) -> HFTokenizer:
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
    else:  # SentencePiece-style: "▁" marks a word start, and decoding drops the first token's leading space
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    wrapped = HFTokenizer.__new__(HFTokenizer)
    wrapped.tok, wrapped.bos_token_id, wrapped.eos_token_id = tok, None, None
    return wrapped


def test_bytes_split_multibyte_characters():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)[1:]
    naive = "".join(tok.decode([t]) for t in ids)
    assert "\ufffd" in naive  # decoding each token alone breaks every multi-byte character
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # the three bytes of 日 come out together, with the third
    pos = [i for i, d in enumerate(deltas) if "日" in d]
    assert len(pos) == 1 and deltas[pos[0]] == "日"


def test_bytes_invalid_sequences_match_full_decode():
    tok = ByteTokenizer()
    ids = [0xE6, 0x97, 65, 0xFF, 0xC3, 0xA9, 0xF0, 0x9F, 66, 0x80, 67, 257, 0xE6, 0x97]  # cut, stray and trailing bytes
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")  # an incomplete character at the very end is flushed as U+FFFD


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_real_tokenizers_keep_word_boundaries_and_characters(kind):
    tok = hf(kind)
    ids = tok.encode(TEXT)
    assert len(ids) > 5
    assert tok.decode(ids) == TEXT
    naive = "".join(tok.decode([t]) for t in ids)
    assert naive != TEXT  # per-token decoding loses spaces or splits characters
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == TEXT


def test_prompt_context_gives_the_first_word_its_space():
    tok = hf("metaspace")
    prompt, out = tok.encode("hello"), tok.encode("hello world")[len(tok.encode("hello")) :]
    assert tok.decode(out) == "world"  # alone, the first output word loses its leading space
    assert "".join(stream(IncrementalDetokenizer(tok, prompt), out)) == " world"


def test_stop_strings_across_pieces_are_excluded():
    m = StopMatcher(["STOP", "\n\n"])
    out = []
    for piece in ["Hello S", "T", "O", "x ST", "OP", " never"]:
        text, hit = m.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello STOx "
    assert m.matched == "STOP"
    assert m.push("more") == ("", True)


def test_stop_prefix_held_back_then_released():
    m = StopMatcher(["abc"])
    assert m.push("xxab") == ("xx", False)  # "ab" could start the stop string
    assert m.push("d") == ("abd", False)
    assert m.push("a") == ("", False)
    assert m.flush() == "a"  # the stream ended without a match: the tail is text


def test_earliest_stop_wins_and_no_stops_pass_through():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == ("hel", True) and m.matched == "lo w"
    assert StopMatcher([]).push("anything") == ("anything", False)
