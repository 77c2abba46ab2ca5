"""Loss scaling for fp16 training, with DeepSpeed's semantics and key names.

Dynamic scaling starts at ``2 ** initial_scale_power``. An overflowing step (any inf/nan in
the gradients) is skipped; the scale is divided by two unless ``hysteresis`` still allows
more overflows, in which case only the hysteresis counter drops. After ``loss_scale_window``
overflow-free steps in a row the scale doubles (and hysteresis is refilled). With
``consecutive_hysteresis`` the counter refills on every good step instead.

Both scalers also answer to DeepSpeed's read-only names for the same state (its ``LossScaler`` and
the ``LossScaleConfig`` its fp16 optimizer exposes as ``loss_scale_config``): ``loss_scale`` and
``cur_scale`` (the scale), ``dynamic_loss_scale``, ``cur_iter`` (steps counted by the scaler,
skipped ones included), ``scale_window``, ``last_overflow_iter``, ``min_loss_scale`` and
``scale_factor``; a static scale has DeepSpeed's values for those (0 and None).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class LossScaler:
    """A fixed loss scale (1.0 disables scaling: bf16 and fp32)."""

    dynamic = False
    cur_iter = 0
    scale_window = last_overflow_iter = min_loss_scale = scale_factor = None

    @property
    def loss_scale(self) -> float:
        return self.scale

    @property
    def cur_scale(self) -> float:
        return self.scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.dynamic

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """Static scaling never changes; an overflow still skips the step."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler (``fp16.loss_scale == 0``)."""

    dynamic = True

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
    ) -> None:
        super().__init__(2.0**initial_scale_power)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_loss_scale)
        self.cur_hysteresis = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    scale_factor = 2.0
    cur_iter = property(lambda self: self.iteration)
    scale_window = property(lambda self: self.window)
    last_overflow_iter = property(lambda self: self.last_overflow_iteration)
    min_loss_scale = property(lambda self: self.min_scale)

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale:
                    raise RuntimeError(
                        f"fp16 gradients overflow at the minimum loss scale {self.min_scale} "
                        "(fp16.min_loss_scale); training cannot continue in fp16 - lower the "
                        "learning rate, or use bf16"
                    )
                new_scale = max(self.scale / 2.0, self.min_scale)
                logger.info("fp16 overflow: step skipped, loss scale %g -> %g", self.scale, new_scale)
                self.scale = new_scale
            else:
                self.cur_hysteresis -= 1
                logger.info("fp16 overflow: step skipped, hysteresis now %d", self.cur_hysteresis)
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
