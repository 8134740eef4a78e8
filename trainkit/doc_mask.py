"""--doc-mask: attention inside each document of a packed row, positions from the document's start.

A row of T tokens usually holds pieces of several documents. With --doc-mask token t attends only to
the earlier tokens of its own document, and its position is counted from that document's first
token, so each document in the row computes exactly what it computes alone in a row of its own.

A document begins at its <|endoftext|> (fineweb.py writes one before each), so token t belongs to
the document opened by the last <|endoftext|> at or before t; the tokens before a row's first one
continue a document of the previous row and form one of their own (positions from 0). The target of
a document's last token is the next document's <|endoftext|>: it is predicted from the document
before it, as that document alone would predict its end. --align-docs rows fit this as they are:
their padding inputs are <|endoftext|>, each a one-token document whose target is ignored.

Two kernels compute the same attention:
- SDPA with the (B, 1, T, T) block-diagonal causal bool mask: on CPU, in eager CUDA, and wherever
  FlexAttention is not used;
- FlexAttention with a document BlockMask in a model compiled on CUDA (its fused kernel exists
  only compiled; eager it is a slow reference, and on CPU it has no backward), which skips the
  blocks that the mask empties.
tests/test_doc_mask.py checks that they agree (forward on CPU); benchmarks/gpu_check.py times both.
Only how rows are fed changes: the model is a plain GPT-2, exported as one.
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
    """(positions, attn_mask) of packed rows idx (B, T) for GPT.hidden_states: FlexAttention's
    BlockMask inside a model compiled on CUDA, else SDPA's bool mask. DOC_MASK_KERNEL=sdpa in the
    environment keeps SDPA there too (benchmarks/gpu_check.py times one against the other)."""
    docs = document_ids(idx)
    use_flex = idx.is_cuda and torch.compiler.is_compiling() and os.environ.get("DOC_MASK_KERNEL") != "sdpa"
    return document_positions(idx), flex_document_mask(docs) if use_flex else sdpa_document_mask(docs)
