"""Each tensor-parallel layer and the vocab-parallel cross entropy against the full module.

One distributed call per tp size runs every case on every rank (cheap: the pool is reused
and the modules are tiny) and returns, per case, the relative errors of the output, the
input gradient and each parameter gradient against this rank's slice of the full ones.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

RTOL = 1e-5
HIDDEN, OUT, BATCH, SEQ = 8, 12, 2, 4


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).float().norm() / want.float().norm().clamp_min(1e-30)).item()


def _chunk(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank]


def _check(name: str, full: nn.Module, tp: nn.Module, x: torch.Tensor, x_local: torch.Tensor,
           to_local_out, to_local_in, rank: int, world: int, partial: tuple[str, ...] = ()) -> dict[str, float]:
    """Run ``full`` on ``x`` and ``tp`` on ``x_local``; compare out, input grad, param grads.

    ``partial``: replicated params whose grad covers only this rank's tokens (row bias under
    sequence parallelism); summed over tp first, as apply_tensor_parallel's hook does.
    """
    full.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.is_floating_point())
    x_local = x_local.detach().requires_grad_(x_local.is_floating_point())
    y = full(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (y * g).sum().backward()
    y_local = tp(x_local)
    (y_local * to_local_out(g)).sum().backward()
    errs = {f"{name}:out": _rel(y_local, to_local_out(y))}
    if x.is_floating_point():
        errs[f"{name}:dx"] = _rel(x_local.grad, to_local_in(x.grad))
    full_params = dict(full.named_parameters())
    for pname, p in tp.named_parameters():
        spec = tp.specs.get(pname)
        if pname in partial:
            torch.distributed.all_reduce(p.grad, group=tp.group)
        want = full_params[pname].grad
        want = spec.shard(want, rank, world) if spec is not None else want
        errs[f"{name}:d{pname}"] = _rel(p.grad, want) if p.grad.shape == want.shape else float("inf")
    return errs


def _conv1d(nx: int, nf: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    m = Conv1D(nf, nx)
    nn.init.normal_(m.bias)
    return m


def layer_cases(tp_size: int) -> dict[str, float]:
    """On every rank: all layer cases at this tp size; returns {case:quantity: rel error}."""
    from parallel3d.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        VocabParallelLMHead,
    )
    from tests.tiny_tp import tp_group

    group = tp_group(tp_size)
    rank, world = torch.distributed.get_rank(group), tp_size
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    same = lambda t: t  # noqa: E731
    cols = lambda t: _chunk(t, -1, rank, world)  # noqa: E731
    seq = lambda t: _chunk(t, 1, rank, world)  # noqa: E731
    errs: dict[str, float] = {}

    for bias in (True, False):
        lin = nn.Linear(HIDDEN, OUT, bias=bias)
        errs |= _check(f"col_linear_bias{bias}", lin, ColumnParallelLinear(lin, group), x, x, cols, same, rank, world)
        lin = nn.Linear(HIDDEN, OUT, bias=bias)
        errs |= _check(f"col_gather_bias{bias}", lin, ColumnParallelLinear(lin, group, gather_output=True), x, x,
                       same, same, rank, world)
        lin = nn.Linear(OUT, HIDDEN, bias=bias)
        xr = torch.randn(BATCH, SEQ, OUT)
        errs |= _check(f"row_linear_bias{bias}", lin, RowParallelLinear(lin, group), xr, cols(xr), same, cols,
                       rank, world)
        errs |= _check(f"row_split_bias{bias}", lin, RowParallelLinear(lin, group, split_input=True), xr, xr, same,
                       same, rank, world)
    # sequence parallelism: column gathers the sequence, row reduce-scatters it
    lin = nn.Linear(HIDDEN, OUT)
    errs |= _check("col_seq", lin, ColumnParallelLinear(lin, group, input_comm="gather_seq"), x, seq(x), cols, seq,
                   rank, world)
    lin = nn.Linear(OUT, HIDDEN)
    xr = torch.randn(BATCH, SEQ, OUT)
    errs |= _check("row_seq", lin, RowParallelLinear(lin, group, output_comm="reduce_scatter_seq"), xr, cols(xr),
                   seq, cols, rank, world, partial=("bias",))
    # Conv1D ([in, out] weights); packed q|k|v split per block, gathered back in order
    conv = _conv1d(HIDDEN, 3 * OUT)
    errs |= _check("conv_col_packed_gather", conv, ColumnParallelLinear(conv, group, gather_output=True, packed=3),
                   x, x, same, same, rank, world)
    conv = _conv1d(HIDDEN, 3 * OUT)
    packed_cols = lambda t: torch.cat([cols(b) for b in t.chunk(3, dim=-1)], dim=-1)  # noqa: E731
    errs |= _check("conv_col_packed", conv, ColumnParallelLinear(conv, group, packed=3), x, x, packed_cols, same,
                   rank, world)
    conv = _conv1d(OUT, HIDDEN)
    errs |= _check("conv_row", conv, RowParallelLinear(conv, group), xr, cols(xr), same, cols, rank, world)

    # vocab-parallel embedding; 13 rows pad to 14 / 16; padding_idx in some rank's range
    ids = torch.randint(0, 13, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    ids[0, 0] = 12
    for pad in (None, 12):
        emb = nn.Embedding(13, HIDDEN, padding_idx=pad)
        errs |= _check(f"embedding_pad{pad}", emb, VocabParallelEmbedding(emb, group), ids, ids, same, same, rank, world)
    errs |= _head_and_loss(group, rank, world)
    return errs


def _head_and_loss(group, rank: int, world: int) -> dict[str, float]:
    """Head + vocab-parallel CE vs nn.Linear + F.cross_entropy (ignore_index, padded vocab)."""
    from parallel3d.tensor_parallel import VocabParallelLMHead, causal_lm_loss, vocab_parallel_cross_entropy

    errs = {}
    for vocab in (13, 16):
        torch.manual_seed(vocab)
        head = nn.Linear(HIDDEN, vocab, bias=False)
        tp_head = VocabParallelLMHead(head, group)
        h = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
        h_local = h.detach().clone().requires_grad_()
        labels = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
        labels[0, 1] = labels[1, 3] = -100
        logits = head(h)
        per_tok = nn.functional.cross_entropy(logits.view(-1, vocab), labels.view(-1), reduction="none")
        weights = torch.rand(BATCH * SEQ, generator=torch.Generator().manual_seed(6))
        (per_tok * weights).sum().backward()
        local = tp_head(h_local)
        got = vocab_parallel_cross_entropy(local, labels, group, vocab_start=tp_head.vocab_start, vocab_size=vocab)
        (got.view(-1) * weights).sum().backward()
        errs[f"ce{vocab}:loss"] = _rel(got.view(-1), per_tok)
        errs[f"ce{vocab}:dh"] = _rel(h_local.grad, h.grad)
        errs[f"ce{vocab}:dW"] = _rel(tp_head.weight.grad, tp_head.specs["weight"].shard(head.weight.grad, rank, world))
        errs[f"ce{vocab}:gathered_logits"] = _rel(tp_head.gather(local), logits)
        # HF's shifted, mean-over-valid-tokens causal LM loss
        from transformers.loss.loss_utils import ForCausalLMLoss

        want = ForCausalLMLoss(logits.detach(), labels, vocab)
        got = causal_lm_loss(local.detach(), labels, group, vocab_start=tp_head.vocab_start, vocab_size=vocab)
        errs[f"ce{vocab}:causal_lm_loss"] = _rel(got, want)
        want = ForCausalLMLoss(logits.detach(), labels, vocab, num_items_in_batch=torch.tensor(5))
        got = causal_lm_loss(local.detach(), labels, group, vocab_start=tp_head.vocab_start, vocab_size=vocab,
                             num_items_in_batch=torch.tensor(5))
        errs[f"ce{vocab}:num_items_in_batch"] = _rel(got, want)
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_full_modules(dist, tp):
    for rank, errs in enumerate(dist.run(tp, layer_cases, tp)):
        bad = {k: v for k, v in errs.items() if not v < RTOL}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errs) > 40


def shard_roundtrip() -> None:
    from parallel3d.tensor_parallel.sharding import make_spec

    full = torch.arange(2 * 30.0).view(2, 30)
    for world in (1, 2, 3, 4):
        for spec in (make_spec(30, 1, world, pad=True), make_spec(2, 0, world, pad=True)):
            shards = [spec.shard(full, r, world) for r in range(world)]
            assert len({s.shape for s in shards}) == 1
            assert torch.equal(spec.unshard(shards), full)
    spec = make_spec(30, 1, 5, packed=3)
    assert torch.equal(spec.unshard([spec.shard(full, r, 5) for r in range(5)]), full)
    assert spec.shard(full, 1, 5)[0].tolist() == [2, 3, 12, 13, 22, 23]
    with pytest.raises(ValueError, match="each of its 3 packed blocks of 10 is not divisible by tensor parallel size 4"):
        make_spec(30, 1, 4, packed=3)


def test_shard_spec_roundtrip():
    shard_roundtrip()
