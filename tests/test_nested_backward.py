"""A parameter whose gradient arrives in several nested backward passes of one engine.backward.

DeepSpeed's TiledMLP recomputes an MLP chunk by chunk inside its backward and calls
torch.autograd.backward once per chunk, so each weight's gradient arrives once per chunk. It
marks all but the last with ``param.ds_grad_is_ready = False``; Zero3D honours that and sums the
parts, so a tiled model trains as the plain one. A function that does the same without the
flag is refused once a part would arrive after its unit was reduced, instead of losing it.
DeepSpeed's TiledFusedLogitsLoss runs its backward inside the *forward*: those gradients
arrive before ``engine.backward`` and count as that micro-batch's (they were once dropped).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import ds_config, max_rel_param_error

HIDDEN, SEQ, CHUNKS = 16, 12, 3


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.tiled = False

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tiled:
            return self.plain(x)
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        return TiledMLP.apply(MLP.plain, self, x, CHUNKS, [self.up.weight, self.down.weight])


class Model(torch.nn.Module):
    def __init__(self, tiled: bool, fused_loss: bool = False) -> None:
        super().__init__()
        self.mlps = torch.nn.ModuleList(MLP() for _ in range(2))
        self.head = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fused_loss = fused_loss
        for mlp in self.mlps:
            mlp.tiled = tiled

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(x), y)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()  # an autograd Function's output needs a differentiable input
        for mlp in self.mlps:
            x = mlp(x)
        if not self.fused_loss:
            return self.loss(x, y)
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        params = [self.head.weight, self.head.bias]
        return TiledFusedLogitsLoss.apply(Model.loss, self, x, y, None, CHUNKS, params, "mean")


def train(stage: int, tiled: bool, fused_loss: bool = False) -> dict:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import parallel3d

    torch.manual_seed(0)
    config = ds_config(stage, 1, 2, lr=1e-2, stage3_param_persistence_threshold=0)
    engine, *_ = parallel3d.initialize(model=Model(tiled, fused_loss), config=config)
    g = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
    for _ in range(3):
        x = torch.randn(2, SEQ, HIDDEN, generator=g)
        engine.backward(engine(x, torch.randn(2, SEQ, HIDDEN, generator=g)))
        engine.step()
    return engine.full_parameters()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tiled_mlp_trains_as_the_plain_model(dist, stage):
    plain = dist.run(2, train, stage, False)
    tiled = dist.run(2, train, stage, True)
    for want, got in zip(plain, tiled):
        err, name = max_rel_param_error(got, want)
        # the chunks' gradients are summed in another order than one matmul sums them: rounding only
        assert err < 1e-5, f"{name} differs by {err:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_computed_inside_forward_count(dist, stage):
    plain = dist.run(2, train, stage, False)
    fused = dist.run(2, train, stage, False, True)
    for want, got in zip(plain, fused):
        err, name = max_rel_param_error(got, want)
        assert err < 1e-5, f"{name} differs by {err:.2e}"


class TwiceWithoutFlag(torch.autograd.Function):
    """Backward of ``layer(x)`` in two chunks, without DeepSpeed's ds_grad_is_ready flag."""

    @staticmethod
    def forward(ctx, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        for part_x, part_grad in zip(x.chunk(2), grad.chunk(2)):
            with torch.enable_grad():
                torch.autograd.backward(ctx.layer(part_x.detach()), part_grad)
        return None, None


class Unflagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TwiceWithoutFlag.apply(self.layer, x.detach().requires_grad_()).square().mean()


def unflagged(stage: int) -> str:
    import parallel3d

    engine, *_ = parallel3d.initialize(model=Unflagged(), config=ds_config(stage, 1, 2, reduce_bucket_size=1))
    try:
        engine.backward(engine(torch.randn(4, HIDDEN)))
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("stage", [1, 2])
def test_a_part_after_the_reduction_is_refused(dist, stage):
    for message in dist.run(2, unflagged, stage):
        assert "arrived again after its ZeRO unit was reduced in this backward" in message
