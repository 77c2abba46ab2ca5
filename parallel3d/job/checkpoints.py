"""Checkpoints of a run: where they live, which one to resume from, and keep-last-k.

Saving itself is the engine's (`Engine.save_checkpoint`: sharded, atomic, a ``latest``
pointer). This module adds the run's policy around it: ``output_dir/checkpoints``, resume
modes, a readability check before launch, and deleting old checkpoints only after a newer
one is complete.

Reading a checkpoint loads torch.distributed.checkpoint (about 0.7 s CPU), so the functions that
read one import the readers when they run: a job that neither resumes nor saves never loads it.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch

from parallel3d.checkpoint.manifest import MANIFEST, METADATA_FILE
from parallel3d.errors import ConfigError
from parallel3d.job.config import JobConfig

logger = logging.getLogger(__name__)

_TAG = re.compile(r"global_step(\d+)")


def checkpoint_root(job: JobConfig) -> Path:
    return Path(job.train.output_dir) / "checkpoints"


def stored_checkpoints(root: Path) -> list[str]:
    """The checkpoints under ``root`` (``output_dir/checkpoints``), newest step first.

    A checkpoint here is any directory named ``global_step<N>`` (what the trainer writes,
    complete or not) or holding a ``checkpoint.json`` or ``dcp.json`` (a tag of another name);
    the hidden ``.<tag>.tmp`` of a save that never finished is not one.
    """
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (
        _TAG.fullmatch(p.name) or (p / MANIFEST).is_file() or (p / METADATA_FILE).is_file())]
    step = {p.name: int(m[1]) if (m := _TAG.fullmatch(p.name)) else -1 for p in found}
    return sorted(step, key=lambda name: (-step[name], name))


def _orphans_message(job: JobConfig, root: Path, tags: list[str]) -> str:
    shown = ", ".join(tags[:4]) + (", ..." if len(tags) > 4 else "")
    return (f"train.output_dir: {root} holds checkpoints ({shown}) but no 'latest' file naming the one to continue "
            f"from, so train.resume={_mode_text(job.train.resume)} would start over and replace them and "
            f"metrics.jsonl; to continue, write the checkpoint's name into {root / 'latest'} (such as "
            f"{tags[0]}) and set train.resume=auto; to start fresh, use another train.output_dir (or delete this one)")


def _mode_text(mode: bool | str) -> str:
    return mode if isinstance(mode, str) else str(mode).lower()


def check_fresh_start(job: JobConfig) -> None:
    """Refuse to start a fresh run where it would replace what an earlier run wrote.

    ``output_dir`` holds an earlier run when ``checkpoints/`` holds a ``latest`` file or any
    checkpoint (`stored_checkpoints`), or, for ``train.resume=false``, a non-empty
    ``metrics.jsonl``. ``resume=auto`` starts fresh only without checkpoints (its metrics.jsonl
    may be its own first attempt's, which a restart after a failure replaces).
    """
    out, root = Path(job.train.output_dir), checkpoint_root(job)
    latest = root / "latest"
    if job.train.resume is False and latest.is_file():
        raise ConfigError(
            f"train.output_dir: {job.train.output_dir} already holds checkpoints (latest: "
            f"{latest.read_text(errors='replace').strip()}); set train.resume=auto to continue that run, or use another "
            "train.output_dir (or delete it) to start fresh")
    tags = stored_checkpoints(root)
    if tags:
        raise ConfigError(_orphans_message(job, root, tags))
    metrics = out / "metrics.jsonl"
    if job.train.resume is False and metrics.is_file() and metrics.stat().st_size > 0:
        raise ConfigError(f"train.output_dir: {out} already holds an earlier run's metrics.jsonl (and no checkpoint to "
                          "continue from); use another train.output_dir (or delete it) to start fresh")


def find_resume(job: JobConfig) -> Path | None:
    """The checkpoint to resume from per train.resume (None: start fresh), checked to be complete.

    Any layout and world size may resume it (checkpoints are mesh-free); whether it holds
    this job's model is :func:`check_resume_model`'s question. A ``latest`` that is damaged or
    names a checkpoint that is missing or incomplete stops here, naming the newest complete
    checkpoint to resume from instead (`parallel3d.job.resume_check`). A fresh start is refused where
    it would replace an earlier run's checkpoints or metrics (`check_fresh_start`).
    """
    root = checkpoint_root(job)
    mode = job.train.resume
    if mode is False or not (root / "latest").is_file():
        if mode is True:
            tags = stored_checkpoints(root)
            if tags:
                raise ConfigError(f"train.resume: true, but {root} has no 'latest' file naming the checkpoint to "
                                  f"continue from (it holds {', '.join(tags[:4])}{', ...' if len(tags) > 4 else ''}); "
                                  f"write that checkpoint's name into {root / 'latest'} (such as {tags[0]})")
            raise ConfigError(f"train.resume: true, but {root} holds no checkpoint (no 'latest' file); "
                              "use train.resume=auto to start fresh when there is none")
        check_fresh_start(job)
        return None
    from parallel3d.export.export import resolve_checkpoint
    from parallel3d.job.resume_check import check_complete, fallback_hint, named_tag

    try:
        path = resolve_checkpoint(root)
        check_complete(path)
    except ConfigError as exc:
        hint = fallback_hint(root, named_tag(root), stored_checkpoints(root))
        raise ConfigError(f"train.resume: {exc}{hint}") from None
    return path


def check_resume_model(path: Path, model: torch.nn.Module) -> None:
    """Refuse a checkpoint of another model (``model`` may be on meta) before any worker starts."""
    from parallel3d.checkpoint.storage import read_metadata

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


class Pruner:
    """keep-last-k once each new checkpoint is published (rank 0 deletes; every rank keeps count).

    A background save (``checkpoint.async_save``) is published steps after ``save_checkpoint``
    returns; pruning right away kept k published checkpoints plus the one in flight, k + 1 in
    the end. `poll` prunes only when no save is in flight, so exactly k remain, and a save that
    fails never costs an older checkpoint.
    """

    def __init__(self, root: Path, keep_last: int, active: bool) -> None:
        self.root, self.keep_last, self.active = root, keep_last, active
        self.owed = False

    def saved(self, engine) -> None:
        self.owed = True
        self.poll(engine)

    def poll(self, engine) -> None:
        if self.owed and not engine.save_in_flight:
            if self.active:
                prune(self.root, self.keep_last)
            self.owed = False
