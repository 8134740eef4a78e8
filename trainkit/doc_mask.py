"""--doc-mask: attention inside each document of a packed row, positions from the document's start, so
each document computes what it would alone. A document begins at its <|endoftext|>; SDPA's bool mask or,
compiled on CUDA, FlexAttention's BlockMask compute the same attention (docs/doc-mask.md).
"""

from __future__ import annotations

import os

import torch
from torch.nn.attention.flex_attention import create_block_mask

from trainkit.tokenizer import EOT


def document_ids(idx: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: which document of its row each token is in (0: the one continued from before)."""
    return (idx == EOT).cumsum(dim=1)


def document_positions(idx: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: each token's position counted from the start of its document."""
    t = torch.arange(idx.size(1), device=idx.device)
    starts = torch.where(idx == EOT, t, 0).cummax(dim=1).values  # the last <|endoftext|> at or before t
    return t - starts


def sdpa_document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query t may attend to key s: same document and s <= t."""
    return (docs[:, :, None] == docs[:, None, :]).tril().unsqueeze(1)


def flex_document_mask(docs: torch.Tensor):
    """The same mask as a FlexAttention BlockMask (one for all heads)."""

    def same_document_causal(b, h, q, k):
        return (docs[b, q] == docs[b, k]) & (k <= q)

    B, T = docs.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=docs.device)


def document_attention(idx: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(positions, attn_mask) of packed rows idx (B, T): FlexAttention's BlockMask compiled on CUDA (unless
    DOC_MASK_KERNEL=sdpa, for benchmarks/gpu_check.py), else SDPA's bool mask."""
    docs = document_ids(idx)
    use_flex = idx.is_cuda and torch.compiler.is_compiling() and os.environ.get("DOC_MASK_KERNEL") != "sdpa"
    return document_positions(idx), flex_document_mask(docs) if use_flex else sdpa_document_mask(docs)
