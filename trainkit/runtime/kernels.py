"""The GPT's forward beyond torch's ops: lm_head + cross-entropy in chunks, never holding the (rows, vocab) logits
(B=64, T=1024: 13 GB in fp32), gradients made in the forward, matmuls on all padded rows (on the first 50257 a chunk's
three took 20% longer), softmax on the real ones; the validation loss; --doc-mask's attention (docs/doc-mask.md)."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from trainkit.data.tokenizer import EOT

# --- the chunked loss -----------------------------------------------------------------------------

IGNORE_INDEX = -1  # targets with this value carry no loss (padding of --align-docs rows)


def exp_sums_(logits):
    """(row maxes m, exps = exp(logits - m) written over the logits, row sums s) of 2-D logits in one pass:
    logsumexp = m + log(s), softmax = exps / s, with no new (rows, vocab) buffer."""
    maxes = logits.amax(dim=-1, keepdim=True)
    exps = logits.sub_(maxes).exp_()
    return maxes.squeeze(1), exps, exps.sum(dim=-1)


def chunked_loss_and_grads(h, weight, targets, scale, chunk_rows, n_real, want_grad):
    """sum(token losses) * scale over targets != IGNORE_INDEX, chunk_rows rows at a time, and if want_grad
    its gradients w.r.t. h and weight (else None, None); scale None: each target's loss (rows,) instead."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    token_losses = torch.empty(h.size(0), dtype=torch.float32, device=h.device) if scale is None else None
    scale = 1.0 if scale is None else scale
    grad_h = torch.empty_like(h) if want_grad else None
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_grad else None
    # one fp32 logits buffer for every chunk: on CPU, glibc hands each freed chunk's 26 MB back to the
    # OS and the next chunk's pages faulted in anew (6,288 page faults a chunk, 10% of the loss's time)
    logits_buffer = (
        torch.empty(min(chunk_rows, h.size(0)), weight.size(0), dtype=torch.float32, device=h.device)
        if h.dtype == weight.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type)
        else None
    )  # (a matmul in another dtype returns its own logits; .float() copies them)
    for start in range(0, h.size(0), chunk_rows):
        hc, tc = h[start : start + chunk_rows], targets[start : start + chunk_rows]
        if logits_buffer is None:
            logits = (hc @ weight.t()).float()
        else:
            logits = torch.mm(hc, weight.t(), out=logits_buffer[: hc.size(0)])
        logits[:, n_real:] = float("-inf")  # exp gives 0: no probability, no gradient
        weights = (tc != IGNORE_INDEX).float() * scale  # per-row loss weight, 0 for ignored
        safe_t = tc.clamp(min=0).unsqueeze(1)
        target_logit = logits.gather(1, safe_t).squeeze(1)
        maxes, exps, sums = exp_sums_(logits)
        lse = maxes + sums.log()
        token_loss = (lse - target_logit) * weights
        if token_losses is not None:
            token_losses[start : start + chunk_rows] = token_loss
        loss += token_loss.sum()
        if want_grad:  # d loss / d logits = weight * (softmax - one-hot)
            dlogits = exps.mul_((weights / sums).unsqueeze(1))
            dlogits.scatter_add_(1, safe_t, -weights.unsqueeze(1))
            grad_h[start : start + chunk_rows] = dlogits @ weight  # autocast picks the matmul dtype
            grad_w.addmm_(dlogits.t(), hc.float())  # accumulate inside the matmul
    return loss if token_losses is None else token_losses, grad_h, grad_w


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward keeps the gradients chunked_loss_and_grads computed; backward scales them."""

    @staticmethod
    def forward(ctx, h, weight, targets, scale, chunk_rows, n_real):
        loss, grad_h, grad_w = chunked_loss_and_grads(h, weight, targets, scale, chunk_rows, n_real, want_grad=True)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None


def chunked_lm_loss(h, weight, targets, scale, chunk_rows, n_real):
    """ChunkedLinearCrossEntropy where a gradient is wanted, else the loss alone (decided here: inside
    Function.forward grad mode is off, and needs_input_grad is True for a Parameter even under no_grad)."""
    if scale is not None and torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(h, weight, targets, scale, chunk_rows, n_real)
    return chunked_loss_and_grads(h, weight, targets, scale, chunk_rows, n_real, want_grad=False)[0]


def full_lm_loss(h, weight, targets, reduction, n_real):
    """Logits (B, T, n_real) of lm_head over h (B, T, C) and their fp32 cross-entropy over targets !=
    IGNORE_INDEX (compiled, the softmax fuses into one pass instead of an fp32 copy of the logits)."""
    logits = F.linear(h, weight)
    loss = F.cross_entropy(
        logits.view(-1, logits.size(-1))[:, :n_real].float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction
    )
    return logits[..., :n_real], loss


@torch.no_grad()
def evaluate_loss(model, rows, B: int, n_batches: int, dist_state, dtype, token_bytes, loss_chunk=0, doc_mask=False):
    """{val_loss: the token mean loss over rows' first n_batches x world size x B rows, val_bpb: the loss of the
    targets with text in bits over their UTF-8 bytes (token_bytes: of each id), left out where none has any}."""
    model.eval()
    device, rank, world = dist_state.device, dist_state.rank, dist_state.world_size
    token_bytes = torch.as_tensor(token_bytes, device=device)
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # summed loss, targets; of the text: loss, bytes
    for i in range(n_batches):
        x, y = (torch.from_numpy(a).to(device) for a in rows.batch((i * world + rank) * B, B))
        with torch.autocast(torch.device(device).type, dtype, enabled=dtype != torch.float32):
            _, losses = model(x, y, reduction="none", loss_chunk=loss_chunk, doc_mask=doc_mask)
        n_bytes = (token_bytes[y.clamp(min=0)] * (y != IGNORE_INDEX)).flatten()
        totals += torch.stack([losses.sum(), (y != IGNORE_INDEX).sum(), (losses * (n_bytes > 0)).sum(), n_bytes.sum()])
    model.train()
    if dist.is_initialized():
        dist.all_reduce(totals)  # summed over the ranks
    loss_sum, n_targets, text_loss, n_bytes = totals.tolist()
    return dict(val_loss=loss_sum / n_targets, **(dict(val_bpb=text_loss / (math.log(2) * n_bytes)) if n_bytes else {}))


# --- --doc-mask -----------------------------------------------------------------------------------


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
    """(positions, attn_mask) of packed rows idx (B, T): a FlexAttention BlockMask compiled on CUDA (unless
    DOC_MASK_KERNEL=sdpa: benchmarks/gpu_check.py), else SDPA's bool mask; the same attention."""
    docs = document_ids(idx)
    use_flex = idx.is_cuda and torch.compiler.is_compiling() and os.environ.get("DOC_MASK_KERNEL") != "sdpa"
    return document_positions(idx), flex_document_mask(docs) if use_flex else sdpa_document_mask(docs)
