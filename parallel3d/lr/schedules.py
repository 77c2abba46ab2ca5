"""DeepSpeed-compatible learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR.

(OneCycle and LRRangeTest are in parallel3d/lr/cycles.py; ``parallel3d.lr.build`` builds all five
from a config section.)

The numbers, keyword names, defaults and checkpoint format (``{"last_batch_iteration": n}``)
match ``deepspeed.runtime.lr_schedules`` so that a DeepSpeed JSON ``"scheduler"`` section and a
DeepSpeed checkpoint carry over unchanged. Differences: invalid arguments raise
:class:`~parallel3d.errors.ConfigError` instead of being logged and silently replaced, and any
object with a ``param_groups`` list of dicts is accepted (not only ``torch.optim.Optimizer``).

Step counting (same as DeepSpeed). ``it = last_batch_iteration``. The constructor, when
``last_batch_iteration == -1``, applies the "not started" lr (``warmup_min_lr`` for WarmupLR /
WarmupDecayLR, ``0.0`` for WarmupCosineLR) without advancing ``it``; every ``step()`` then does
``it += 1`` and applies the lr for the new ``it``. So the first ``step()`` applies ``it = 0``,
which is again the minimum (log(1) = 0 and 0 / n = 0): the first two optimizer steps of a
training loop that calls ``scheduler.step()`` after each optimizer step run at the minimum lr.
With ``last_batch_iteration >= 0`` (resume) the constructor leaves the lrs alone.

Warmup fraction, shared by all three (``n = max(2, warmup_num_steps)``; DeepSpeed raises 1 to 2
so that log(n) is not 0), for ``0 <= it < n``::

    log:    w(it) = (1 / ln(n)) * ln(it + 1)
    linear: w(it) = it / n
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

from parallel3d.errors import ConfigError

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

WARMUP_TYPES = ("log", "linear")

LrSpec = Union[float, Sequence[float]]


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} is invalid: it must be a positive integer")


def _per_group(optimizer: Any, value: LrSpec, name: str) -> list[float]:
    """A scalar broadcast to every param group, or a list/tuple with one value per group."""
    n_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(f"{name}={list(value)!r} is invalid: a list must have one value per "
                              f"param group ({n_groups}), got {len(value)}")
        return list(value)
    return [value] * n_groups


def _apply_lrs(param_groups: list[dict], lrs: Sequence[float]) -> list:
    """Write ``lrs`` into the groups (in place for tensor lrs) and return the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if hasattr(group["lr"], "fill_"):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


class ScheduleBase:
    """Step counting, lr application and the state dict that every DeepSpeed schedule shares."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise ConfigError(f"last_batch_iteration={last_batch_iteration!r} is invalid: "
                              f"it must be an integer >= -1")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _after_step(self) -> None:
        """What a schedule sets besides the lr (OneCycle's momentum)."""

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: previous + 1) and apply its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _apply_lrs(self.optimizer.param_groups, self.get_lr())
        self._after_step()

    def get_last_lr(self) -> list:
        """The lrs last written into the param groups."""
        if self._last_lr is None:
            raise RuntimeError("get_last_lr(): no lr applied yet; call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": int(self.last_batch_iteration)}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])


class _WarmupSchedule(ScheduleBase):
    """The warmup fraction and total-steps check shared by the three warmups."""

    def __init__(self, optimizer: Any, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int) -> None:
        _check_positive_int("warmup_num_steps", warmup_num_steps)
        if warmup_type not in WARMUP_TYPES:
            raise ConfigError(f"warmup_type={warmup_type!r} is invalid: it must be one of "
                              f"{', '.join(repr(t) for t in WARMUP_TYPES)}")
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)  # DeepSpeed: keeps log(n) > 0
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    @staticmethod
    def _check_total(total_num_steps: int, warmup_num_steps: int) -> None:
        _check_positive_int("warmup_num_steps", warmup_num_steps)
        _check_positive_int("total_num_steps", total_num_steps)
        if total_num_steps < warmup_num_steps:
            raise ConfigError(f"total_num_steps={total_num_steps} is invalid: it must be >= "
                              f"warmup_num_steps ({warmup_num_steps})")

    def _start(self) -> None:
        """DeepSpeed applies the 'not started' lr at construction only for a fresh schedule."""
        if self.last_batch_iteration == -1:
            self._last_lr = _apply_lrs(self.optimizer.param_groups, self.get_lr())

    def _warmup_fraction(self) -> float:
        """w(it): ln(it+1)/ln(n) for 'log', it/n for 'linear' (only meaningful while it < n)."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps


class WarmupLR(_WarmupSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``lr(it) = min_lr + (max_lr - min_lr) * g(it)`` with ``g = w(it)`` (see module doc) for
    ``it < n`` and ``g = 1`` after; ``lr = min_lr`` before the first step. ``warmup_min_lr`` and
    ``warmup_max_lr`` are scalars or one value per param group; ``warmup_max_lr=None`` (the
    DeepSpeed default, despite its docstring saying 0.001) takes each group's current lr.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: LrSpec = 0.0,
                 warmup_max_lr: LrSpec | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            # float(): a tensor lr is filled in place later and must not alias max_lr
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (delta * gamma) for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from ``warmup_max_lr`` to ``warmup_min_lr`` at step ``total``.

    After warmup ``g(it) = max(0, (total - it) / max(1, total - n))``, so the lr reaches
    ``min_lr`` at ``it == total_num_steps`` and stays there.
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: LrSpec = 0.0,
                 warmup_max_lr: LrSpec = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self._check_total(total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_WarmupSchedule):
    """Scale each group's initial lr by a ratio: warm up, then cosine-decay to ``cos_min_ratio``.

    ``lr(it) = lr0 * r(it)``, ``lr0`` = the group's lr at construction, ``r = 0`` before the
    first step. Warmup (``it < n``): ``r = warmup_min_ratio + (1 - warmup_min_ratio) * w(it)``.
    After: ``p = min(1, (it - n + 1) / max(1, total - n))``,
    ``r = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``, so the ratio
    stays at ``cos_min_ratio`` from ``total_num_steps`` on (DeepSpeed >= 0.18 clamps ``p``).
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self._check_total(total_num_steps, warmup_num_steps)
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr0 * ratio for lr0 in self.org_lrs]
