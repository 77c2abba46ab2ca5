"""What the Trainer's loop holds in place of a wrapped model, an optimizer and an LR scheduler.

``transformers.Trainer`` drives training through three objects: ``model_wrapped`` (called,
put in train/eval mode, ``zero_grad()``, ``accelerator.no_sync(model)``), ``self.optimizer``
(``step()`` at the end of each accumulation window) and ``self.lr_scheduler`` (``step()``
after the optimizer, ``get_last_lr()`` for logging). With Zero3D the engine does all three
itself, at the end of the window's last micro-batch (parallel3d/hf/trainer.py, ``training_step``):
it reduces, clips, steps the optimizer and then its LR schedule (skipping the schedule on an
fp16 overflow, as DeepSpeed does). These views let the loop's calls land harmlessly and read
the engine's state, so no step happens twice.
"""

from __future__ import annotations

import contextlib
from typing import Any

from parallel3d.engine.engine import Engine


class EngineModel:
    """The Trainer's ``model_wrapped``: calls go through the engine (its forward gathers ZeRO-3
    parameters and checks the batch on every rank); everything else reaches the HF model."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    @property
    def module(self):
        return self.engine.module

    @property
    def training(self) -> bool:
        return self.engine.module.training

    def train(self, mode: bool = True) -> EngineModel:
        self.engine.train(mode)
        return self

    def eval(self) -> EngineModel:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine clears its gradient buffers when a window's step ends."""

    @contextlib.contextmanager
    def no_sync(self):
        """accelerate's ``no_sync(model)`` lands here for all but a window's last micro-batch; the
        engine already knows which backward reduces (``set_gradient_accumulation_boundary``)."""
        yield

    def parameters(self, recurse: bool = True):
        return self.engine.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.engine.module.named_parameters(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not yet set (unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.engine.module, name)


class EngineOptimizer:
    """The Trainer's ``self.optimizer``: ``step()`` and ``zero_grad()`` are no-ops (the engine stepped
    at the window's last micro-batch); ``param_groups`` and ``state_dict()`` are the engine's."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.engine.optimizer.inner.defaults

    def step(self, closure=None) -> None:
        """The engine already stepped (see the module docstring)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradients itself."""

    def state_dict(self) -> dict:
        return self.engine.optimizer.inner.state_dict()


class EngineScheduler:
    """The Trainer's ``self.lr_scheduler``: ``step()`` is a no-op (the engine steps its schedule after
    each applied optimizer step); the learning rate read for logging is the engine's."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def step(self, *args, **kwargs) -> None:
        """The engine already stepped its schedule."""

    def get_last_lr(self) -> list[float]:
        schedule = self.engine.lr_scheduler
        if schedule is not None and hasattr(schedule, "get_last_lr"):
            return list(schedule.get_last_lr())
        return self.engine.get_lr()

    def state_dict(self) -> dict:
        schedule = self.engine.lr_scheduler
        return schedule.state_dict() if schedule is not None else {}
