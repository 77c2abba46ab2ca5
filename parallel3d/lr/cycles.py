"""DeepSpeed's cyclic learning-rate schedules: ``OneCycle`` and ``LRRangeTest``.

Numbers, keyword names, defaults and the checkpoint format (``{"last_batch_iteration": n}``)
are those of ``deepspeed.runtime.lr_schedules``, so a DeepSpeed ``"scheduler"`` section gives
the same learning rates (tests/test_lr_schedules.py compares them step by step). As in
parallel3d/lr/schedules.py, invalid arguments raise ``ConfigError``.

OneCycle (``it = last_batch_iteration``, ``T = first + second`` step sizes): during the cycle
(``it < T``) the lr climbs linearly from ``cycle_min_lr`` to ``cycle_max_lr`` over the first
``cycle_first_step_size`` steps and falls back over the second; with a stair count the climb
is a staircase. After the cycle the lr is ``cycle_min_lr / (1 + decay_lr_rate * k /
decay_step_size)`` at ``k`` steps past it (``cycle_min_lr`` if the decay is off). With
``cycle_momentum`` (optimizers with ``betas``) the first beta moves the other way, between
``cycle_max_mom`` and ``cycle_min_mom``, and DeepSpeed sets the second beta to 0.99.
"""

from __future__ import annotations

import math
from typing import Any

from parallel3d.errors import ConfigError
from parallel3d.lr.schedules import LrSpec, ScheduleBase, _apply_lrs, _check_positive_int, _per_group

__all__ = ["OneCycle", "LRRangeTest"]

_SECOND_BETA = 0.99  # DeepSpeed's OneCycle pairs every cycled first beta with 0.99


class OneCycle(ScheduleBase):
    """The 1Cycle policy: one triangle of lr (and inverse momentum), then an optional decay."""

    def __init__(self, optimizer: Any, cycle_min_lr: LrSpec, cycle_max_lr: LrSpec, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: LrSpec = 0.8,
                 cycle_max_mom: LrSpec = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ConfigError(f"cycle_first_step_size={cycle_first_step_size!r} is invalid: it must be positive")
        if second < 0:
            raise ConfigError(f"cycle_second_step_size={cycle_second_step_size!r} is invalid: it must be >= 0")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        if last_batch_iteration == -1:
            self._last_lr = _apply_lrs(optimizer.param_groups, self.min_lrs)
        self.cycle_momentum = cycle_momentum and all("betas" in g for g in optimizer.param_groups)
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(m, _SECOND_BETA) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, _SECOND_BETA) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for group, betas in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _scale_factor(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # from the integer offset, as DeepSpeed: a float scale may fall just under a stair
            offset = it % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b0 * (1 + self.decay_mom_rate * interval), b1) for b0, b1 in self.max_moms]

    def _after_step(self) -> None:
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class LRRangeTest(ScheduleBase):
    """The lr range test: ``lr = min_lr * (1 + step_rate * (it + 1) / step_size)`` (floored with a staircase)."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: LrSpec = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_positive_int("lr_range_test_step_size", lr_range_test_step_size)
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = _apply_lrs(optimizer.param_groups, self.min_lr)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]
