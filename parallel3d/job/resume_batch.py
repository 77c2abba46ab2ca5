"""A resumed job must keep the checkpoint's global batch: checked once, before any worker starts.

The data position continues only with the same global batch (parallel3d/job/sampler.py): the
checkpoint's ``train_batch_size`` blocks per step, whatever the layout. `prepare` checks it in
the ``zero3d train`` process (or on the first rank of each node under ``zero3d launch``), so
the refusal is one message, not one per rank, and it names the settings that restore the
checkpoint's batch on this world size: the micro-batch / accumulation pair closest to the
job's own (or, when the data-parallel size does not divide it, that no pair can).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parallel3d.errors import ConfigError


def saved_global_batch(resume_from: Path) -> int | None:
    """The ``train_batch_size`` the checkpoint was trained with (None when it does not say)."""
    from parallel3d.checkpoint.checkpoint import decode_value, read_manifest

    manifest = read_manifest(resume_from)
    saved = (manifest.get("written_by") or {}).get("train_batch_size")
    if not isinstance(saved, int):
        data = (decode_value(manifest.get("client_state")) or {}).get("data") or {}
        saved = data.get("train_batch_size") if isinstance(data, dict) else None
    return saved if isinstance(saved, int) and not isinstance(saved, bool) else None


def restoring_settings(saved: int, dp: int, micro: int, accumulation: int, given: set[str]) -> dict[str, int] | None:
    """Batch settings that give ``saved`` blocks per step on ``dp`` data-parallel ranks, changing
    as little of (micro, accumulation) as possible; None when ``dp`` does not divide ``saved``.
    ``given``: the batch keys the job's engine config sets (train_batch_size is kept consistent)."""
    if saved % dp:
        return None
    per_rank = saved // dp
    if per_rank % micro == 0:
        out = {"gradient_accumulation_steps": per_rank // micro}
    elif per_rank % accumulation == 0:
        out = {"train_micro_batch_size_per_gpu": per_rank // accumulation}
    else:
        out = {"train_micro_batch_size_per_gpu": per_rank, "gradient_accumulation_steps": 1}
    if "train_batch_size" in given:
        out = {"train_batch_size": saved, **out}
    return out


def check_resume_batch(job_engine: Any, resolved: Any, resume_from: Path | None) -> None:
    """Refuse to resume ``resume_from`` with another global batch, naming the settings that restore it.

    ``job_engine``: the job's ``engine`` section as written (a dict, or the path of a DeepSpeed
    JSON); ``resolved``: its `Zero3DConfig` for this world size.
    """
    if resume_from is None:
        return
    saved = saved_global_batch(resume_from)
    now = resolved.train_batch_size
    if saved is None or saved == now:
        return
    dp, micro = resolved.data_parallel_size, resolved.train_micro_batch_size_per_gpu
    accumulation = resolved.gradient_accumulation_steps
    head = (f"train.resume: checkpoint {resume_from} was trained with a global batch of {saved} blocks per step "
            f"(train_batch_size) but this run's is {now} (train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accumulation} x data-parallel size {dp}); the data position continues "
            f"only with the same global batch")
    given = set(job_engine) if isinstance(job_engine, dict) else set()
    settings = restoring_settings(saved, dp, micro, accumulation, given)
    if settings is None:
        fix = (f"no micro-batch and accumulation give {saved} on data-parallel size {dp}: run on a world size "
               f"whose data-parallel size divides {saved}")
    elif isinstance(job_engine, dict):
        fix = "to keep it on this world size, resume with " + " ".join(f"engine.{k}={v}" for k, v in settings.items())
    else:
        fix = f"to keep it on this world size, set in {job_engine}: " + ", ".join(
            f'"{k}": {v}' for k, v in settings.items())
    raise ConfigError(f"{head}; {fix}; or use another train.output_dir to start a new run with this batch")
