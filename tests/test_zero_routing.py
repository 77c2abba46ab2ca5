"""Parameters that get gradients on some ranks only (mixture of experts): ZeRO 0-3 at dp 2 and 4.

Routing is forced to differ across ranks and micro-batches, so in a step an expert may be hit
on one rank only, or on none (its parameters get no gradient anywhere and ``torch.optim``
leaves them untouched: no weight decay, no Adam step). The oracle is one process running
``torch.optim.AdamW`` over the same global batch.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

from tests.dist_harness import DistTestError
from tests.tiny import MICRO, SEQ, VOCAB, ds_config, max_rel_param_error, oracle_run, rank_micro_batches

STEPS, GAS = 4, 2
RTOL = 1e-5
EXPERTS = 6


class MoELayer(nn.Module):
    """Top-1 routed expert MLPs: only the experts that got a token run (as HF's MoE blocks do)."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        weight = F.softmax(self.gate(x), dim=-1).gather(1, route[:, None])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (route == e).nonzero(as_tuple=True)[0]
            if sel.numel():
                out = out.index_add(0, sel, expert(x[sel]) * weight[sel])
        return x + out


class TinyMoE(nn.Module):
    """Embedding, one MoE layer, head. Token ``t`` is routed to expert ``t % EXPERTS`` (hash routing).

    ``_no_split_modules`` makes the MoE layer stage 3's fetch unit: it runs on every rank, so
    it is gathered in agreement whichever of its experts run.
    """

    _no_split_modules = ["MoELayer"]

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.moe = MoELayer(hidden, EXPERTS)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids).reshape(-1, self.embed.embedding_dim)
        h = self.moe(x, (input_ids % EXPERTS).reshape(-1))
        return SimpleNamespace(loss=F.cross_entropy(self.head(h), labels.reshape(-1)))


def make_moe() -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE()


def make_mixtral() -> nn.Module:
    """A tiny Mixtral (top-1 of 4 experts) whose router sends token ``t`` to expert ``t % 4``.

    Embedding rows point along one unit direction per expert and each router row along its
    expert's direction with a large gain, so routing follows the token id through training.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=1, max_position_embeddings=64)
    model = MixtralForCausalLM(cfg)
    directions = torch.linalg.qr(torch.randn(32, 4))[0].t()  # 4 orthonormal rows
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.1).add_(directions[torch.arange(VOCAB) % 4])
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(10.0 * directions)
    return model


def routed_batches(experts: int, dp: int, seed: int = 3) -> torch.Tensor:
    """Token ids [STEPS, GAS, dp, MICRO, SEQ]: step s, micro a, rank r only hits expert (s+r+a) % experts."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB // experts, (STEPS, GAS, dp, MICRO, SEQ), generator=g) * experts
    for s in range(STEPS):
        for a in range(GAS):
            for r in range(dp):
                data[s, a, r] += (s + r + a) % experts
    return data


MODELS = {"moe": (make_moe, EXPERTS), "mixtral": (make_mixtral, 4)}


def train_ranks(kind: str, stage: int, dp: int) -> tuple[list[float], dict]:
    import parallel3d

    make, experts = MODELS[kind]
    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0, reduce_bucket_size=500)
    engine, _, _, _ = parallel3d.initialize(model=make(), config=config)
    data_iter = iter(rank_micro_batches(routed_batches(experts, dp), torch.distributed.get_rank()))
    losses = [engine.train_batch(data_iter) for _ in range(STEPS)]
    return losses, engine.full_parameters()


@functools.cache
def oracle(kind: str, dp: int):
    make, experts = MODELS[kind]
    return oracle_run(kind, routed_batches(experts, dp), model=make())


@pytest.mark.parametrize("kind,stage,dp", [(k, s, d) for k in MODELS for d in (2, 4) for s in (0, 1, 2, 3)])
def test_routed_experts_match_single_process(dist, kind, stage, dp):
    want_losses, want_params = oracle(kind, dp)
    for losses, params in dist.run(dp, train_ranks, kind, stage, dp):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"


def test_oracle_skips_experts_no_rank_hit():
    """The check above can fail: an expert hit nowhere in a step keeps its value (no weight decay)."""
    data = routed_batches(EXPERTS, 2)[:1]  # one step: experts 0, 1, 2 hit
    model = make_moe()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, after = oracle_run("moe", data, model=model)
    assert torch.equal(after["moe.experts.5.0.weight"], before["moe.experts.5.0.weight"])
    assert not torch.equal(after["moe.experts.1.0.weight"], before["moe.experts.1.0.weight"])


class SkippingBlocks(nn.Module):
    """Two stage-3 fetch blocks; rank 1 skips the first (layer drop on some ranks only)."""

    _no_split_modules = ["Linear"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (i == 0 and torch.distributed.get_rank() == 1):
                x = block(x)
        return x.square().mean()


def _skip_a_block() -> None:
    import parallel3d

    torch.manual_seed(0)
    engine, _, _, _ = parallel3d.initialize(model=SkippingBlocks(), config=ds_config(3, 1, 2, stage3_param_persistence_threshold=0))
    engine.train_batch(iter([(torch.randn(MICRO, 8),)]))


def test_stage3_block_skipped_on_one_rank_is_named(dist):
    with pytest.raises(DistTestError, match=r"fetch module #1 \(Linear\) ran on this rank where fetch module #0"):
        dist.run(2, _skip_a_block, timeout=60)
