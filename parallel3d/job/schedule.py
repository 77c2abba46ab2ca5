"""Which LR schedule a resumed run follows when ``train.max_steps`` changed since its checkpoint.

``scheduler.params.total_num_steps: auto`` is filled with the job's total steps. A run that is
extended (``train.max_steps`` raised, ``train.resume=auto``) would refit the schedule to the
new total, and the LR would jump at the resume point (a WarmupDecayLR that had decayed to
7.4e-06 at step 300 of 300 restarts at 3.1e-04 when refit to 350 steps). DeepSpeed restores
the scheduler from the checkpoint (``load_lr_scheduler_states``), so the rule here is the
same: ``auto`` means the total the checkpoint was trained with, saved in its client state
(``"schedule"``), and the saved schedule continues. A number given in the config is used as
given, as DeepSpeed does. Either way, when the schedule that runs differs from the saved one,
or the saved one has already ended, one line says which is used, why, the LR it gives at the
next steps, and the setting that picks the other.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from parallel3d.errors import ConfigError

STATE_KEY = "schedule"
"""The client_state key of the schedule's totals (``{"total_num_steps": N}``)."""


def schedule_state(engine_config: dict) -> dict | None:
    """What a checkpoint keeps of the schedule: its total_num_steps (None without one)."""
    params = (engine_config.get("scheduler") or {}).get("params") or {}
    total = params.get("total_num_steps")
    return {"total_num_steps": total} if isinstance(total, int) and not isinstance(total, bool) else None


def _saved(resume_from: Path) -> tuple[dict | None, int | None]:
    """The checkpoint's saved schedule state and its scheduler's last_batch_iteration."""
    from parallel3d.checkpoint.checkpoint import decode_value, read_manifest

    manifest = read_manifest(resume_from)
    client = decode_value(manifest.get("client_state")) or {}
    scheduler = decode_value(manifest.get("lr_scheduler")) or {}
    state = client.get(STATE_KEY) if isinstance(client, dict) else None
    iteration = scheduler.get("last_batch_iteration") if isinstance(scheduler, dict) else None
    return (state if isinstance(state, dict) else None), (iteration if isinstance(iteration, int) else None)


def lr_at(engine_config: dict, iteration: int) -> float:
    """The first param group's LR of the config's schedule after ``iteration`` (a scheduler's
    ``last_batch_iteration``), computed on a stand-in optimizer."""
    from parallel3d.lr.build import build_lr_scheduler

    lr = float(((engine_config.get("optimizer") or {}).get("params") or {}).get("lr", 1e-3))
    stand_in = SimpleNamespace(param_groups=[{"lr": lr}])
    scheduler = engine_config["scheduler"]
    schedule = build_lr_scheduler(stand_in, scheduler["type"], scheduler.get("params"))
    schedule.step(iteration)
    return float(schedule.get_last_lr()[0])


def _with_total(engine_config: dict, total: int) -> dict:
    out = copy.deepcopy(engine_config)
    out["scheduler"]["params"]["total_num_steps"] = total
    return out


def resumed_schedule(job_engine: Any, engine_config: dict, resume_from: Path | None,
                     total_steps: int) -> tuple[dict, str | None]:
    """``engine_config`` with the schedule a resumed run follows, and the line to log about it (or None).

    ``job_engine`` is the job's ``engine`` section as written (to tell ``auto`` from a number).
    """
    params = (job_engine.get("scheduler") or {}).get("params") if isinstance(job_engine, dict) else None
    this = schedule_state(engine_config)
    if resume_from is None or not isinstance(params, dict) or this is None:
        return engine_config, None
    state, iteration = _saved(resume_from)
    saved = state.get("total_num_steps") if state else None
    auto, new = params.get("total_num_steps") == "auto", this["total_num_steps"]
    if not isinstance(saved, int) or iteration is None:
        return engine_config, (None if not auto else (
            f"scheduler: the checkpoint does not record its schedule's total_num_steps (it was written before "
            f"Zero3D kept it): 'auto' fits the schedule to this job's {new} steps"))
    kind = engine_config["scheduler"]["type"]
    saved_cfg = _with_total(engine_config, saved)
    used, other = (saved_cfg, engine_config) if auto else (engine_config, saved_cfg)
    # after step s the scheduler is at iteration s - 1: step s + 1 runs at the LR it set then
    # (the optimizer's saved one), step s + 2 at the loaded schedule's LR for iteration s
    s1, s2 = iteration + 2, iteration + 3
    try:
        now, kept, refit = lr_at(saved_cfg, iteration), lr_at(used, iteration + 1), lr_at(other, iteration + 1)
    except ConfigError:
        return used, None  # the schedule itself is refused when the engine builds it, with its message
    if auto and saved != new:
        return used, (
            f"scheduler: continuing the checkpoint's {kind} schedule (total_num_steps {saved}, as its LR scheduler "
            f"state was saved): LR {now:.3g} at step {s1}, {kept:.3g} at step {s2}; 'auto' refit to this job's "
            f"{new} steps would move it to {refit:.3g} at step {s2}"
            + (f"; it reaches its final LR {lr_at(used, saved):.3g} at step {saved + 2}, which holds through "
               f"step {total_steps}" if saved + 2 < total_steps else "")
            + f"; to decay over the new total instead, set engine.scheduler.params.total_num_steps={new}")
    if saved != new:
        return used, (
            f"scheduler: total_num_steps {new} (set in the engine config) replaces the checkpoint's {saved}: the "
            f"{kind} LR moves from {now:.3g} at step {s1} to {kept:.3g} at step {s2} (the saved schedule gives "
            f"{refit:.3g}); set total_num_steps: auto to continue the saved schedule")
    if saved + 2 < total_steps:
        return used, (f"scheduler: the {kind} schedule (total_num_steps {saved}) reaches its final LR "
                      f"{lr_at(used, saved):.3g} at step {saved + 2}, which holds through step {total_steps}; set "
                      f"engine.scheduler.params.total_num_steps={total_steps} to decay over them instead")
    return used, None
