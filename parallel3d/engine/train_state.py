"""The engine's counters, in one record that only the engine writes.

``global_steps`` (optimizer-step windows done, skipped fp16 steps included, as in DeepSpeed),
``micro_steps`` (micro-batches done), ``global_samples`` (samples over all data-parallel ranks)
and whether the last window's optimizer step changed the parameters. The step loops report what
a window did (:class:`WindowOutcome`); a checkpoint load and a partial load hand the engine a
saved :meth:`TrainState.state_dict`; the engine applies both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TrainState", "WindowOutcome"]


@dataclass(frozen=True)
class WindowOutcome:
    """What a step loop's ``train`` did: the window's loss on this rank and, when the loop stepped
    the optimizer itself (a pipeline schedule), whether the step was applied and over how many
    micro-batches; ``stepped=None`` when each micro-batch went through ``engine.step()``, which
    counted it."""

    loss: torch.Tensor
    stepped: bool | None = None
    micro_batches: int = 0


@dataclass
class TrainState:
    """The counters (module docstring)."""

    global_steps: int = 0
    micro_steps: int = 0
    global_samples: int = 0
    step_applied: bool = False

    def end_window(self, stepped: bool, samples: int) -> None:
        """An optimizer-step window ended; ``stepped``: its step changed the parameters."""
        self.step_applied = stepped
        self.global_steps += 1
        self.global_samples += samples

    def state_dict(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_steps = int(state["global_steps"])
        self.global_samples = int(state["global_samples"])
        self.micro_steps = int(state["micro_steps"])
