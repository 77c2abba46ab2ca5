"""fp16 dynamic loss scaling with gradient accumulation skips the same steps as DeepSpeed.

DeepSpeed divides the loss by ``gradient_accumulation_steps`` in the loss's own dtype and then
multiplies by the loss scale; with a scale of 2**16 the gradient entering the fp16 loss is
already inf (fp16 tops out at 65504), so DeepSpeed skips that step. Multiplying once by
``scale / gas`` would not overflow there: the runs would skip different steps and drift apart.
The model is DeepSpeed's own test model (Linear layers and a cross entropy), whose loss is
computed in fp16, in one process and at dp 2, ZeRO stages 1 and 2. DeepSpeed's CPU accelerator
reports fp16 as unsupported, which only guards its fused kernels; the oracle lifts that check.
"""

from __future__ import annotations

import pytest
import torch

HIDDEN, MICRO, GAS, STEPS = 16, 4, 2, 10
FP16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 2}


class SimpleModel(torch.nn.Module):
    """DeepSpeed's tests/unit/simple_model.py SimpleModel with two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


def _config(stage: int, dp: int) -> dict:
    return {"train_batch_size": MICRO * GAS * dp, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0, "steps_per_print": 1000,
            "fp16": dict(FP16), "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(MICRO, HIDDEN, generator=g).half() * 4, torch.randint(0, HIDDEN, (MICRO,), generator=g))
            for _ in range(STEPS * GAS)]


def _scaler_state(engine) -> tuple:
    """The loss-scale state read through DeepSpeed's names, which Zero3D's optimizer answers to as well."""
    optimizer, scaler = engine.optimizer, engine.optimizer.loss_scaler
    return (optimizer.cur_scale, optimizer.dynamic_loss_scale, scaler.loss_scale, scaler.cur_iter,
            scaler.last_overflow_iter, scaler.scale_window, scaler.cur_hysteresis)


def _train(engine, rank: int, scale_of) -> dict:
    skipped, scales, losses, states = [], [], [], []
    for i, (x, y) in enumerate(_batches(rank)):
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if i % GAS == GAS - 1:
            skipped.append(engine.skipped_steps)
            scales.append(float(scale_of(engine)))
            losses.append(float(loss))
            states.append(_scaler_state(engine))
    return {"skipped": skipped, "scales": scales, "losses": losses, "states": states}


def zero3d_run(stage: int, dp: int) -> dict:
    import parallel3d

    torch.manual_seed(0)
    engine, *_ = parallel3d.initialize(model=SimpleModel(), config=_config(stage, dp))
    return _train(engine, torch.distributed.get_rank(), lambda e: e.optimizer.loss_scale)


def deepspeed_run(stage: int, dp: int) -> dict:
    from tests.ds_oracle import allow_fp16_on_cpu, make_engine

    allow_fp16_on_cpu()
    torch.manual_seed(0)
    engine = make_engine(SimpleModel(), _config(stage, dp), [{"input_ids": torch.zeros(MICRO, 1)}])
    try:
        return _train(engine, torch.distributed.get_rank(), lambda e: e.optimizer.cur_scale)
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dp", [1, 2])
def test_fp16_skips_the_steps_deepspeed_skips(dist, dp, stage):
    ours = dist.run(dp, zero3d_run, stage, dp)
    theirs = dist.run(dp, deepspeed_run, stage, dp)
    for mine, ds in zip(ours, theirs):
        assert mine["skipped"] == ds["skipped"]
        assert mine["scales"] == ds["scales"]
        assert mine["states"] == ds["states"]
    # the schedule is not trivial: the first step overflows at 2**16 and later ones after the scale regrows
    skips = ours[0]["skipped"]
    assert skips[0] == 1 and skips[-1] > 2, skips
