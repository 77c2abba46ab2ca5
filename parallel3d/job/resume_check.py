"""Which checkpoint a run can resume from when ``latest`` cannot be: the fallback a resume error offers.

``checkpoints/latest`` names the newest checkpoint; when it is damaged (not a tag, empty) or
names a checkpoint that is missing or damaged, the resume stops. The message then names the
newest other checkpoint of the run that is complete, and how to resume from it: write its tag
into ``latest`` (there is no setting that names a tag; ``latest`` is that setting).

"Complete" is what can be checked without reading the tensors: the manifest and the tensor
index (``dcp.json``) read and belong to one save, and every file the index names is there
with at least the bytes its chunks need. The chunks' checksums are verified when the
checkpoint loads (each rank the bytes it reads).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from parallel3d.checkpoint.checkpoint import read_manifest
from parallel3d.checkpoint.manifest import check_pair
from parallel3d.checkpoint.storage import METADATA_FILE, CorruptCheckpointError, read_metadata
from parallel3d.errors import ConfigError
from parallel3d.runtime.worker_errors import REPORTED_BY_RANK0

logger = logging.getLogger(__name__)

_STEP = re.compile(r"global_step(\d+)")


def check_complete(path: Path) -> None:
    """Raise a ConfigError naming what is missing unless ``path`` is a complete checkpoint."""
    manifest = read_manifest(path)
    metadata = read_metadata(path)
    check_pair(manifest, metadata.storage_meta.save_id if metadata.storage_meta is not None else None, path)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise ConfigError(f"checkpoint file {file} is damaged (missing): {path / METADATA_FILE} names it") from None
        if size < end:
            raise ConfigError(f"checkpoint file {file} is damaged (truncated): {size} bytes, its chunks need {end}")


def is_complete(path: Path) -> bool:
    try:
        check_complete(path)
    except ConfigError:
        return False
    return True


def named_tag(root: Path) -> str | None:
    """What ``root/latest`` says, stripped (None without a readable one)."""
    try:
        return (root / "latest").read_text(errors="replace").strip()
    except OSError:
        return None


def fallback_hint(root: Path, bad: str | None, candidates: list[str]) -> str:
    """The sentence to add to a resume error: the newest complete checkpoint among ``candidates``
    (tags under ``root``, newest first) other than ``bad``, and how to resume from it."""
    latest = root / "latest"
    for tag in candidates:
        if tag == bad or not is_complete(root / tag):
            continue
        text = f"; the newest complete checkpoint there is {tag}: to resume from it, write {tag} into {latest}"
        bad_step, step = (_STEP.fullmatch(bad or ""), _STEP.fullmatch(tag))
        if bad_step and step and int(bad_step[1]) > int(step[1]) and (root / bad).is_dir():
            text += f" (move {root / bad} aside first to keep it: the run saves over it at step {bad_step[1]})"
        return text
    return f"; {root} holds no other complete checkpoint to resume from"


def names_checkpoint(message: str, path: Path) -> bool:
    """Whether ``message`` names the checkpoint directory ``path`` (or a file in it)."""
    return re.search(re.escape(str(path)) + r"(?![\w.+-])", message) is not None


def with_fallback(error: ConfigError, resumed: Path | None, candidates: list[str]) -> ConfigError:
    """``error`` with the fallback hint added when it says that ``resumed`` is damaged (a chunk's
    checksum, a chunk that is no tensor), else itself: a checkpoint of another model or optimizer
    is no better at an earlier step."""
    if (resumed is None or not isinstance(error, CorruptCheckpointError)
            or not names_checkpoint(str(error), resumed)):
        return error
    out = type(error)(f"{error}{fallback_hint(resumed.parent, resumed.name, candidates)}")
    if getattr(error, REPORTED_BY_RANK0, False):
        setattr(out, REPORTED_BY_RANK0, True)
    return out
