"""Stage 3's fetch units on models that use their modules in ways module hooks do not see.

* A block whose output is a view (a Linear on a 3-D input) that the caller then changes in
  place: the in-place op moves the view to a new autograd node, which drops a hook registered
  on it; the block must still be gathered before its backward (RoCBert's ``map_inputs_layer``).
* A model without ``_no_split_modules`` whose forward calls a submodule's ``_forward`` past its
  hooks (ProphetNet's positional embedding): its layers (the members of its ``ModuleList``) are
  the fetch units, and the rest is gathered for the whole micro-batch.
* The input embedding (``get_input_embeddings()``; the first model's, used between every two
  blocks) is a fetch unit of its own, gathered for each forward use and never for backward (its gradient
  accumulates into shape-only placeholders); the blocks are gathered again in backward.

Each runs ZeRO-3 at dp 2 on the same batch on both ranks and must equal one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.tiny import ds_config, max_rel_param_error


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)  # on a 3-D input: a view of the matmul's output


class InPlaceOnBlockOutput(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(16) for _ in range(3))
        self.shift = nn.Embedding(8, 16)

    def get_input_embeddings(self) -> nn.Module:  # as HF models name theirs
        return self.shift

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for i, block in enumerate(self.blocks):
            h = block(h)
            h += self.shift(torch.full(h.shape[:2], i, dtype=torch.long))  # in place on the view
            h = torch.tanh(h)
        return nn.functional.mse_loss(h, y)


class Positions(nn.Embedding):
    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)


class HooklessCall(nn.Module):
    """No _no_split_modules; the positions are looked up through ``_forward``, past the hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = Positions(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x + self.positions._forward(torch.arange(x.shape[1]))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(h, y)


MODELS = {"in_place_on_view": InPlaceOnBlockOutput, "hookless_call": HooklessCall}


def train(kind: str) -> dict:
    import parallel3d

    torch.manual_seed(0)
    model = MODELS[kind]()
    config = ds_config(3, 1, torch.distributed.get_world_size(), stage3_param_persistence_threshold=0)
    engine, *_ = parallel3d.initialize(model=model, config=config)
    gathers = _count_gathers(engine.optimizer.fetcher)
    g = torch.Generator().manual_seed(7)  # the same batch on every rank: dp 2 then equals one process
    losses = []
    for _ in range(3):
        gathers.clear()  # the last step's
        loss = engine(torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    fetch = [type(m).__name__ for m, _ in engine.optimizer.fetcher.module_units] if engine.optimizer.fetcher else []
    return {"losses": losses, "params": engine.full_parameters(), "fetch": fetch, "gathers": dict(gathers)}


def _count_gathers(fetcher) -> dict:
    """Gathers started per (fetch module class, inside backward), counted as they start."""
    counts: dict = {}
    if fetcher is None:
        return counts
    owner = {id(u): type(m).__name__ for m, units in fetcher.module_units for u in units}
    start = fetcher._start_gather

    def counting(unit) -> None:
        if not unit.is_materialized and id(unit) not in fetcher._in_flight:
            key = (owner.get(id(unit), "root"), torch._C._current_graph_task_id() != -1)
            counts[key] = counts.get(key, 0) + 1
        start(unit)

    fetcher._start_gather = counting
    return counts


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_stage3_matches_one_process(dist, kind):
    (whole,) = dist.run(1, train, kind)
    for r in dist.run(2, train, kind):
        assert r["losses"] == pytest.approx(whole["losses"], rel=1e-6)
        err, name = max_rel_param_error(r["params"], whole["params"])
        assert err < 1e-6, f"{name} differs by {err:.2e}"
        if kind == "in_place_on_view":
            assert r["fetch"] == ["Embedding"] + ["Block"] * 3
            # per step: the table for each of its 3 forward uses, never inside backward
            assert {k: v for k, v in r["gathers"].items() if k[0] == "Embedding"} == {("Embedding", False): 3}
            assert r["gathers"].get(("Block", True), 0) > 0  # blocks are gathered again for backward
        else:
            assert r["fetch"] == ["Linear"] * 3


def test_only_plain_embeddings_skip_the_backward_gather():
    """Placeholders serve an embedding whose backward reads no weights: ``nn.Embedding`` itself, not
    a subclass (its forward may differ), nor one with sparse gradients or an in-place max_norm."""
    from zero.stage3 import backward_reads_no_weights

    assert backward_reads_no_weights(nn.Embedding(4, 2))
    assert not backward_reads_no_weights(nn.Embedding(4, 2, sparse=True))
    assert not backward_reads_no_weights(nn.Embedding(4, 2, max_norm=1.0))
    assert not backward_reads_no_weights(Positions(4, 2))
    assert not backward_reads_no_weights(nn.Linear(2, 2))
