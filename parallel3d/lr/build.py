"""A DeepSpeed ``"scheduler"`` section -> one of the five schedules (the three warmups of
parallel3d/lr/schedules.py, the two cycles of parallel3d/lr/cycles.py), its params checked
against the schedule's signature."""

from __future__ import annotations

import inspect
from typing import Any

from parallel3d.errors import ConfigError
from parallel3d.lr.cycles import LRRangeTest, OneCycle
from parallel3d.lr.schedules import ScheduleBase, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LR_SCHEDULES", "build_lr_scheduler"]

LR_SCHEDULES: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
"""Every schedule by its DeepSpeed name."""


def build_lr_scheduler(optimizer: Any, type: str, params: dict | None) -> ScheduleBase:
    """Build a schedule from a DeepSpeed ``"scheduler": {"type": ..., "params": {...}}`` section."""
    schedules = LR_SCHEDULES
    if type not in schedules:
        raise ConfigError(f"scheduler.type={type!r} is invalid: it must be one of "
                          f"{', '.join(schedules)}")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ConfigError(f"scheduler.params={params!r} is invalid: it must be a dict")
    cls = schedules[type]
    sig = list(inspect.signature(cls).parameters.values())[1:]  # drop optimizer
    allowed = [p.name for p in sig]
    for key in params:
        if key not in allowed:
            raise ConfigError(f"scheduler.params.{key}={params[key]!r} is invalid: {type} accepts "
                              f"only {', '.join(allowed)}")
    for p in sig:
        if p.default is inspect.Parameter.empty and p.name not in params:
            raise ConfigError(f"scheduler.params.{p.name} is missing: {type} requires it")
    return cls(optimizer, **params)
