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

from parallel3d.checkpoint import resolve_tag
from parallel3d.errors import ConfigError
from parallel3d.job.config import JobConfig

logger = logging.getLogger(__name__)

_TAG = re.compile(r"global_step(\d+)")


def checkpoint_root(job: JobConfig) -> Path:
    return Path(job.train.output_dir) / "checkpoints"


def find_resume(job: JobConfig, world_size: int) -> Path | None:
    """The checkpoint to resume from per train.resume (None: start fresh), checked to be readable."""
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
        path = resolve_tag(root, None)
    except ConfigError as exc:
        raise ConfigError(f"train.resume: {exc}") from None
    files = sorted(path.glob("rank*.pt"))
    if len(files) != world_size:
        raise ConfigError(f"train.resume: checkpoint {path} was written by {len(files)} processes; this run has "
                          f"{world_size} (resume with the same world size)")
    for file in files:
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ConfigError(f"train.resume: checkpoint file {file} is unreadable: {exc}") from None
    return path


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
