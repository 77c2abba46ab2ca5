"""Checkpoints of a run: where they live, which one to resume from, and keep-last-k.

Saving itself is the engine's (`Engine.save_checkpoint`: sharded, atomic, a ``latest``
pointer). This module adds the run's policy around it: ``output_dir/checkpoints``, resume
modes, a readability check before launch, and deleting old checkpoints only after a newer
one is complete.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch

from parallel3d.checkpoint import read_manifest
from parallel3d.checkpoint_storage import read_metadata
from parallel3d.errors import ConfigError
from parallel3d.export import resolve_checkpoint
from parallel3d.job.config import JobConfig

logger = logging.getLogger(__name__)

_TAG = re.compile(r"global_step(\d+)")


def checkpoint_root(job: JobConfig) -> Path:
    return Path(job.train.output_dir) / "checkpoints"


def find_resume(job: JobConfig) -> Path | None:
    """The checkpoint to resume from per train.resume (None: start fresh), checked to be complete.

    Any layout and world size may resume it (checkpoints are mesh-free); whether it holds
    this job's model is :func:`check_resume_model`'s question.
    """
    root = checkpoint_root(job)
    latest = root / "latest"
    mode = job.train.resume
    if mode is False:
        if latest.is_file():
            raise ConfigError(
                f"train.output_dir: {job.train.output_dir} already holds checkpoints (latest: "
                f"{latest.read_text().strip()}); set train.resume=auto to continue that run, or use another "
                "train.output_dir (or delete it) to start fresh")
        return None
    if not latest.is_file():
        if mode is True:
            raise ConfigError(f"train.resume: true, but {root} holds no checkpoint (no 'latest' file); "
                              "use train.resume=auto to start fresh when there is none")
        return None
    try:
        path = resolve_checkpoint(root)
        read_manifest(path)
        read_metadata(path)
    except ConfigError as exc:
        raise ConfigError(f"train.resume: {exc}") from None
    return path


def check_resume_model(path: Path, model: torch.nn.Module) -> None:
    """Refuse a checkpoint of another model (``model`` may be on meta) before any worker starts."""
    want = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    saved = {fqn[len("model/") :]: list(md.size) for fqn, md in read_metadata(path).state_dict_metadata.items()
             if fqn.startswith("model/")}
    problems = [f"{n}: checkpoint {saved[n]}, model {s}" for n, s in want.items() if n in saved and saved[n] != s]
    problems += [f"{n} missing from the checkpoint" for n in want if n not in saved]
    problems += [f"{n} not in the model" for n in saved if n not in want]
    if problems:
        raise ConfigError(f"train.resume: checkpoint {path} was written for another model ({'; '.join(problems[:3])}"
                          f"{'; ...' if len(problems) > 3 else ''}); use another train.output_dir to start fresh")


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest ``global_step*`` checkpoints (never ``latest``'s)."""
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    tags = sorted((int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _TAG.fullmatch(p.name)))
    removed = []
    for _, path in tags[: max(0, len(tags) - keep_last)]:
        if path.name != latest:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.info("removed old checkpoint %s (train.keep_last %d)", path, keep_last)
    return removed
