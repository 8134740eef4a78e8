"""The tokenizer files of an export: GPT-2's tokenizer as a transformers fast tokenizer that AutoTokenizer
loads, built offline from the BPE the trainer encodes with, without transformers."""

from __future__ import annotations

import os

from trainkit.cli import UserError
from trainkit.export_folder import write_json
from trainkit.tokenizer import EOT, EOT_TEXT, get_encoding


# written as files, not through transformers: the same bytes whatever versions export, in the form the
# oldest allowed reads (tokenizers 0.19 cannot read merges as pairs; 4.x has no TokenizersBackend, and
# 5.x's GPT2Tokenizer would rebuild the pre-tokenizer): PreTrainedTokenizerFast exists in both
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _byte_chars() -> list[str]:
    """Byte-level BPE's printable stand-in for each byte value (GPT-2's bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [chars[b] for b in range(256)]


def gpt2_tokenizer_files(model_max_length: int) -> dict[str, dict]:
    """GPT-2's tokenizer as a fast tokenizer's files (name -> JSON value): r50k_base's ids, split pattern,
    merges (TikTokenConverter's rule), <|endoftext|> as bos/eos/unk matched in text as id 50256 (as
    encode_prompt allows). model_max_length: the block size, which pipeline truncates to."""
    try:
        enc = get_encoding()
    except RuntimeError as e:  # offline without TIKTOKEN_CACHE_DIR: its one-line hint
        raise UserError(str(e)) from None
    ranks, chars = enc._mergeable_ranks, _byte_chars()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = sorted(
        (rank, ranks[token[:i]], ranks[token[i:]], text(token[:i]), text(token[i:]))
        for token, rank in ranks.items()
        for i in range(1, len(token))
        if token[:i] in ranks and token[i:] in ranks
    )
    byte_level = dict(type="ByteLevel", add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            dict(
                id=EOT, content=EOT_TEXT, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True
            )
        ],
        "normalizer": None,
        "pre_tokenizer": dict(
            type="Sequence",
            pretokenizers=[
                dict(type="Split", pattern=dict(Regex=enc._pat_str), behavior="Isolated", invert=False),
                dict(byte_level, add_prefix_space=False, use_regex=False),
            ],
        ),
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": dict(
            type="BPE",
            dropout=None,
            unk_token=None,
            continuing_subword_prefix=None,
            end_of_word_suffix=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=True,
            vocab={text(token): rank for token, rank in ranks.items()},
            merges=[f"{left} {right}" for *_, left, right in merges],
        ),  # no token holds a space
    }
    specials = dict(bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT)
    config = dict(
        tokenizer_class=TOKENIZER_CLASS,
        **specials,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "special_tokens_map.json": specials}


def save_tokenizer(out_dir: str, model_max_length: int, shown: str):
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    for name, value in gpt2_tokenizer_files(model_max_length).items():
        write_json(os.path.join(out_dir, name), value, shown)
