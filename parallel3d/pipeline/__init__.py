"""Pipeline parallelism: schedules as data (``schedules``), their simulation (``simulate``)
and drawing (``draw``, needs matplotlib for PNGs)."""

from parallel3d.pipeline.actions import Action, Kind
from parallel3d.pipeline.schedules import SCHEDULES, add_communication, compute_only, schedule_table
from parallel3d.pipeline.simulate import Costs, Interval, ScheduleError, SimResult, simulate

__all__ = [
    "SCHEDULES", "Action", "Costs", "Interval", "Kind", "ScheduleError", "SimResult", "add_communication",
    "compute_only", "schedule_table", "simulate",
]
