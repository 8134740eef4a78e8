"""GPT-2's tokenizer (r50k_base, offline from bpe/'s checked copy), the real vocabulary, each token's bytes."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import sys

import numpy as np
import tiktoken

from trainkit.cli import UserError, print0, reason_of

ENCODING_NAME = "r50k_base"  # GPT-2's BPE; tiktoken's "gpt2" is the same table but fetches extra files
EOT = 50256  # <|endoftext|>
GPT2_VOCAB = EOT + 1  # tokens of GPT-2's BPE: <|endoftext|> is the last
EOT_TEXT = "<|endoftext|>"
BPE_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"  # where tiktoken fetches it
BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # what tiktoken requires of it
# the copy in bpe/ beside trainkit/ (bpe/README.md: where it came from), found through a symbolic link too
SHIPPED_BPE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "bpe", "r50k_base.tiktoken"
)
_BPE_HINT = "or set TIKTOKEN_CACHE_DIR to a folder that holds tiktoken's cached r50k_base file"


def real_vocab_size(vocab_size: int) -> int:
    """The ids of a vocab_size-row model that are tokens: every softmax and an export keep these only."""
    return min(vocab_size, GPT2_VOCAB)


def token_byte_lengths(vocab_size: int, hint: str | None = None) -> np.ndarray:
    """UTF-8 bytes of each token id's text (bits per byte's denominator): 0 for <|endoftext|> and padded ids,
    and for every id of a model smaller than GPT-2's (nanochat's definition). hint: another way out."""
    lengths = np.zeros(vocab_size, dtype=np.int64)
    if vocab_size >= GPT2_VOCAB:
        enc = get_tokenizer_or_fail(hint)
        lengths[:EOT] = [len(enc.decode_single_token_bytes(t)) for t in range(EOT)]
    return lengths


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 tokenizer, once per process (a cache, else bpe/'s copy, else a download); RuntimeError with a hint."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    cached = os.path.join(cache_dir, hashlib.sha1(BPE_URL.encode()).hexdigest()) if cache_dir else None
    if cached and os.path.isfile(cached):
        damaged = True  # (or unreadable) checked here: tiktoken deletes a damaged copy, saying nothing
        with contextlib.suppress(OSError), open(cached, "rb") as f:
            damaged = hashlib.sha256(f.read()).hexdigest() != BPE_SHA256
        if not damaged:
            with contextlib.suppress(Exception):
                return tiktoken.get_encoding(ENCODING_NAME)
        elif os.path.exists(SHIPPED_BPE):
            print0(
                f"note: the GPT-2 tokenizer file {cached} in TIKTOKEN_CACHE_DIR is damaged (another "
                f"sha256); using {SHIPPED_BPE} instead (delete the damaged file to silence this)",
                file=sys.stderr,
            )
    if os.path.exists(SHIPPED_BPE):
        return shipped_encoding()
    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    except Exception as e:
        raise RuntimeError(
            f"could not load the GPT-2 tokenizer: {SHIPPED_BPE} is missing and tiktoken could not fetch "
            f"{ENCODING_NAME!r} ({reason_of(e)}); restore the file (git checkout -- bpe), {_BPE_HINT}"
        ) from e


def get_tokenizer_or_fail(hint: str | None = None):
    """get_encoding() for a command: a UserError (with hint, another way out) instead of a RuntimeError."""
    try:
        return get_encoding()
    except RuntimeError as e:
        raise UserError(f"{e} (or {hint})" if hint else str(e)) from None


def shipped_encoding(path: str = SHIPPED_BPE) -> tiktoken.Encoding:
    """tiktoken's r50k_base built from the rank file at path, without its download or cache."""
    from tiktoken_ext.openai_public import r50k_pat_str

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise RuntimeError(
            f"could not load the GPT-2 tokenizer: cannot read {path}: {reason_of(e)}; {_BPE_HINT}"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != BPE_SHA256:
        raise RuntimeError(
            f"could not load the GPT-2 tokenizer: {path} is damaged (sha256 {digest[:16]}..., expected "
            f"{BPE_SHA256[:16]}...); restore it (git checkout -- bpe), {_BPE_HINT}"
        )
    # lines of "base64(token bytes) rank", as tiktoken.load.load_tiktoken_bpe reads them
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
    return tiktoken.Encoding(
        ENCODING_NAME,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: EOT},
        explicit_n_vocab=GPT2_VOCAB,
    )


def encode_documents(enc: tiktoken.Encoding, docs: list) -> np.ndarray:
    """[EOT] + enc.encode_ordinary(doc) per doc, as uint16, in one call (joined by <|endoftext|>); a document
    holding that literal text is encoded on its own. A lone surrogate raises UnicodeEncodeError."""
    parts, start = [], 0
    for i, doc in enumerate(docs):
        if EOT_TEXT in doc:
            parts.append(_encode_joined(enc, docs[start:i]))
            parts.append(np.array([EOT], dtype=np.uint32))
            parts.append(enc.encode_to_numpy(doc, disallowed_special=()))  # as encode_ordinary(doc)
            start = i + 1
    parts.append(_encode_joined(enc, docs[start:]))
    tokens = np.concatenate(parts)
    if tokens.size and tokens.max() > np.iinfo(np.uint16).max:
        raise UserError(f"token id {tokens.max()} does not fit in uint16; the tokenizer is not GPT-2's {ENCODING_NAME}")
    return tokens.astype("<u2")


def _encode_joined(enc: tiktoken.Encoding, docs: list) -> np.ndarray:
    if not docs:
        return np.empty(0, dtype=np.uint32)
    return enc.encode_to_numpy(EOT_TEXT + EOT_TEXT.join(docs), allowed_special={EOT_TEXT})
