"""Optimizers on sharded parameters: those not known to update elementwise are refused under ZeRO
and tensor parallelism unless ``zero_allow_untested_optimizer`` (DeepSpeed's rule and key).

Adafactor's factored second moment on a flat shard is not its moment on the whole matrix: under
ZeRO-1 it trained other parameters (0.06 off after three steps) without a word, and DeepSpeed's
own test of the rule hung its harness under the shim (the expected AssertionError never came).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from parallel3d.errors import ConfigError, UntestedOptimizerError


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


class ElementwiseSGD(torch.optim.SGD):
    """A user's subclass: not on the list (its step could be anything), elementwise in fact."""


def _config(stage: int, allow: bool | None = None) -> dict:
    config = {"train_batch_size": 4, "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0}
    if allow is not None:
        config["zero_allow_untested_optimizer"] = allow
    return config


def _refusal(stage: int, optimizer: str) -> str:
    """The error initialize raises for ``optimizer`` at ``stage`` (one rank), or "no error"."""
    import parallel3d

    model = _Regression()
    built = {"adafactor": lambda: torch.optim.Adafactor(model.parameters(), lr=0.1),
             "subclass": lambda: ElementwiseSGD(model.parameters(), lr=0.1)}[optimizer]
    try:
        parallel3d.initialize(model=model, optimizer=built(), config=_config(stage))
    except ConfigError as exc:
        assert isinstance(exc, (UntestedOptimizerError, AssertionError))
        return str(exc)
    return "no error"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adafactor", "subclass"])
def test_an_optimizer_not_known_elementwise_is_refused_under_zero(dist, stage, optimizer):
    said = dist.run(1, _refusal, stage, optimizer)[0]
    assert f"ZeRO stage {stage}" in said and "zero_allow_untested_optimizer" in said
    assert ("Adafactor" if optimizer == "adafactor" else "ElementwiseSGD") in said


def test_without_sharding_any_optimizer_runs(dist):
    assert dist.run(1, _refusal, 0, "adafactor")[0] == "no error"


def _train(stage: int, allow: bool, factory: bool) -> float:
    """Three steps of a user's elementwise SGD subclass at ``stage`` against plain torch; the
    largest parameter difference."""
    import parallel3d

    torch.manual_seed(0)
    model = _Regression()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        plain.zero_grad()
        reference(x, y).backward()
        plain.step()
    optimizer = ((lambda groups: ElementwiseSGD(groups, lr=0.1, momentum=0.9)) if factory
                 else ElementwiseSGD(model.parameters(), lr=0.1, momentum=0.9))
    engine = parallel3d.initialize(model=model, optimizer=optimizer, config=_config(stage, allow))[0]
    for _ in range(3):
        engine.backward(engine(x, y))
        engine.step()
    return max((a - b).abs().max().item() for a, b in zip(engine.full_parameters().values(),
                                                             reference.parameters()))


def test_zero_allow_untested_optimizer_lets_it_run(dist):
    assert dist.run(1, _train, 2, True, False)[0] < 1e-6


def _factory_refusal() -> str:
    try:
        _train(1, False, True)
    except UntestedOptimizerError as exc:
        return str(exc)
    return "no error"


def test_an_optimizer_factory_is_checked_by_what_it_builds(dist):
    assert "ElementwiseSGD" in dist.run(1, _factory_refusal)[0]
