"""Tokenizers: a checkpoint's `tokenizer.json` through `tokenizers` (the shipped `tiny` is a checkpoint), and
bytes for `tiny-random` or when asked (`--tokenizer bytes`). A checkpoint without a tokenizer that loads is an
error naming the file (mimo_epd/common/checkpoint.py `resolve_tokenizer`), never a silent fall back to bytes."""

from __future__ import annotations

import json
import os

from mimo_epd.common.model_names import TINY_RANDOM, resolve_model


class ByteTokenizer:
    """`tiny-random`'s tokenizer: one token per UTF-8 byte; 256 = BOS, 257 = EOS."""

    bos_token_id, eos_token_id = 256, 257
    vocab_size = 258
    path = "bytes"  # what /get_model_info reports as the tokenizer

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's `tokenizer.json` (and its special tokens from `tokenizer_config.json` / `config.json`)."""

    def __init__(self, path: str, bos_token_id: int | None = None, eos_token_id: int | None = None):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        self.path = path
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tok.encode(text).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _special_ids(model_dir: str) -> tuple[int | None, int | None]:
    path = os.path.join(model_dir, "config.json")
    try:
        cfg = json.loads(open(path).read())
    except (OSError, ValueError):
        return None, None
    eos = cfg.get("eos_token_id")
    return cfg.get("bos_token_id"), (eos[0] if isinstance(eos, list) and eos else eos)


def load_tokenizer(model: str, tokenizer: str = ""):
    """The tokenizer of `model` (`tiny`: the shipped one): `tokenizer` when given (a tokenizer.json, a directory
    holding one, or `bytes`), else the checkpoint's `tokenizer.json`; bytes for `tiny-random`. Raises
    CheckpointError (a ValueError naming the file) when there is none or it does not load."""
    from mimo_epd.common.checkpoint import BYTES, Checkpoint, resolve_tokenizer

    d = resolve_model(model) if model != TINY_RANDOM else ""
    tok = os.path.join(d, "tokenizer.json") if d else ""
    ckpt = Checkpoint(model, d, "", None, None, None, None, tok if tok and os.path.isfile(tok) else "")
    path = resolve_tokenizer(ckpt, tokenizer)
    if path == BYTES:
        return ByteTokenizer()
    return HFTokenizer(path, *_special_ids(d)) if d else HFTokenizer(path)
