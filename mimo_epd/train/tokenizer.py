"""The tiny model's tokenizer: a byte-level BPE trained with the `tokenizers` package, and its chat template.

`train_tokenizer(texts, vocab_size)` learns the merges on the training split only (in the given order, so the
same corpus gives the same vocabulary). The vocabulary starts with the special tokens (ids 0..8, `SPECIAL`), then
the 256 byte symbols, then the merges. The pre-tokenizer and decoder are `ByteLevel` (no prefix space, GPT-2
split regex), so any UTF-8 string encodes and decodes back unchanged.

Special tokens, reserved now for the chat format (MiMo's conventions):
- `<|endoftext|>` (0): BOS at the start of every sequence, and padding; `<|im_start|>` (1), `<|im_end|>` (2,
  the end of a turn: EOS) are special (skipped when decoding);
- `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` (3..8) are single
  tokens that decode as text, so a reasoning parser and a tool-call parser see them in the output.

`save_tokenizer(tok, directory)` writes `tokenizer.json` and `tokenizer_config.json` (special tokens and the Jinja
chat template from `chat_template.jinja` beside this module), the files transformers' `PreTrainedTokenizerFast`
and llm_backend's `HFTokenizer` / `load_chat_template` read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

BOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIAL = [BOS, IM_START, IM_END, *TEXT_TOKENS]
CHAT_TEMPLATE = (Path(__file__).resolve().parent / "chat_template.jinja").read_text(encoding="utf-8")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The thinking and tool-call markers stay single tokens (ids 3..8) but decode as text: not special.
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        if added["content"] in TEXT_TOKENS:
            added["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    for t in SPECIAL:
        assert tok.token_to_id(t) == SPECIAL.index(t), t
    return tok


def save_tokenizer(tok, directory: str | Path, model_max_length: int) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": BOS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
