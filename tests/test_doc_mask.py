"""--doc-mask (trainkit/runtime/kernels.py): a packed row computes exactly what each of its documents computes
alone, in the model, through the command line, in validation and in --eval-only; FlexAttention's
document mask agrees with SDPA's; a doc-mask-trained model exports as a plain GPT-2."""

import json
import math

import pytest
import torch

from trainkit.runtime import kernels
import train_gpt2 as tg
from conftest import log_records, tiny_run_args
from trainkit.data.tokenizer import token_byte_lengths
from shards import EOT, loss_and_grads

CONFIG = tg.GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=16)
# conftest's data_dir: short documents, several to a packed row
SHARDS = dict(n_docs=300, seed=3, vocab=300, min_len=2, max_len=12, shard_size=1500)


def packed_batch():
    """Two rows of 24 tokens: row 0 continues a document from before its first <|endoftext|> and holds three more;
    row 1 is two documents and the padding of an --align-docs row (inputs <|endoftext|>, targets -1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 500, (2, 24), generator=g)
    y = torch.randint(0, 500, (2, 24), generator=g)
    x[0, [5, 9, 10]] = EOT  # a one-token document at 9
    x[1, [0, 13]] = EOT
    x[1, 20:] = EOT
    y[1, 20:] = -1
    y[0, [4, 8, 9]] = EOT  # a document's last target is the <|endoftext|> that opens the next one
    y[1, 12] = EOT
    return x, y


def documents(x, y):
    """(row, start, end) of each document of each row: a new one at every <|endoftext|> input."""
    spans = []
    for b in range(x.size(0)):
        starts = sorted({0, *(x[b] == EOT).nonzero().flatten().tolist()})
        spans += [(b, s, e) for s, e in zip(starts, starts[1:] + [x.size(1)])]
    return spans


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_positions_and_documents_restart_at_each_endoftext_and_flex_attention_agrees_with_sdpa():
    """FlexAttention's fused kernel needs torch.compile on CUDA (benchmarks/gpu_check.py); on CPU its eager forward
    (no backward) still checks that the BlockMask is SDPA's mask."""
    x, _ = packed_batch()
    docs, positions = kernels.document_ids(x), kernels.document_positions(x)
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, *range(14)]
    assert positions[1].tolist() == [*range(13), *range(7), 0, 0, 0, 0]
    assert docs[0].tolist() == [0] * 5 + [1] * 4 + [2] + [3] * 14
    mask = kernels.sdpa_document_mask(docs)
    assert mask.shape == (2, 1, 24, 24)
    assert mask[0, 0, 8].tolist() == [False] * 5 + [True] * 4 + [False] * 15  # its own document, up to itself
    assert mask[1, 0, 22].tolist() == [False] * 22 + [True, False]  # padding attends to itself only
    torch.manual_seed(0)
    model = tg.GPT(CONFIG).eval()
    with torch.no_grad():
        sdpa = model.hidden_states(x, positions, mask)
        flex = model.hidden_states(x, positions, kernels.flex_document_mask(docs))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_chunk", [0, 16])
def test_packed_rows_equal_each_document_alone(loss_chunk):
    x, y = packed_batch()
    n = int((y != -1).sum())
    assert len(documents(x, y)) == 10  # the four padding tokens are one-token documents
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.float64, 1e-12))[: 1 if loss_chunk else 2]:  # (chunks: fp32)
        torch.manual_seed(0)
        model = tg.GPT(CONFIG).to(dtype)
        packed_loss, packed = loss_and_grads(model, lambda: model(x, y, loss_chunk=loss_chunk, doc_mask=True)[1])

        # each document in a row of its own: plain causal attention, positions from 0
        each = lambda b, s, e: model(x[b : b + 1, s:e], y[b : b + 1, s:e], reduction="sum", loss_chunk=loss_chunk)[1]
        alone_loss, separate = loss_and_grads(model, lambda: sum(each(*doc) for doc in documents(x, y)) / n)
        assert packed_loss == pytest.approx(alone_loss, rel=tolerance)
        # fp32: relative to the whole gradient (a small tensor's sums cancel to a few ulps more);
        # fp64: each tensor on its own
        whole = torch.cat([g.flatten() for g in separate.values()]).norm()
        for k in separate:
            scale = whole if dtype == torch.float32 else separate[k].norm()
            assert (packed[k] - separate[k]).norm() <= tolerance * scale, (dtype, k)
        plain_loss, _ = loss_and_grads(model, lambda: model(x, y, loss_chunk=loss_chunk)[1])
        assert abs(plain_loss - alone_loss) > 1e-4  # without the mask the rows compute something else


def test_validation_and_eval_only_equal_each_document_alone_and_export_is_plain_gpt2(data_dir, tmp_path, capsys):
    """Through the command line: two steps of --doc-mask on packed rows of data_dir's short documents, validated."""
    out = tmp_path / "run"
    sizes = dict(steps=2, seq_len=32, rows=4, warmup=1, val_every=2, ckpt_every=2)
    flags = tiny_run_args(data_dir, out, "--val-steps", "2", "--doc-mask", **sizes)
    assert tg.main(flags) == 0
    capsys.readouterr()
    model = tg.GPT.from_checkpoint(str(out / "ckpt_0000002.pt"))
    x, y = (torch.from_numpy(a) for a in tg.TokenRows(data_dir, "val", 32).batch(0, 8))  # --val-steps 2 x -B 4
    nats, n_targets, text_nats = 0.0, 0, 0.0
    with torch.no_grad():
        for b, s, e in documents(x, y):
            _, losses = model(x[b : b + 1, s:e], y[b : b + 1, s:e], reduction="none")
            nats += losses.sum().item()
            text_nats += losses[y[b, s:e] != EOT].sum().item()
            n_targets += e - s
    n_bytes = int(token_byte_lengths(50304)[y.flatten()].sum())  # GPT-2's ids below 300: 1 to 7 bytes each
    alone = dict(val_loss=nats / n_targets, val_bpb=text_nats / (math.log(2) * n_bytes))
    logged = [r for r in log_records(out) if "val_loss" in r][-1]
    assert logged["step"] == 2 and {k: logged[k] for k in alone} == pytest.approx(alone, rel=1e-6)
    assert tg.main([*flags, "--max-steps", "2", "--eval-only", "--resume"]) == 0  # --eval-only: the mask too
    logged = [r for r in log_records(out) if "val_loss" in r][-1]
    del logged["run"]  # the run id of the log's records: no part of an evaluation's result
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == logged
    assert {k: logged[k] for k in alone} == pytest.approx(alone, rel=1e-6)
    pytest.importorskip("transformers")
    import hf_interop
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_interop.export_hf(str(out / "ckpt_0000002.pt"), str(tmp_path / "hf")))
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0][..., :50257], rtol=0, atol=1e-5)
