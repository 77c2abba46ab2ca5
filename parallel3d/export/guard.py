"""What ``zero3d export`` may write to: never a directory that holds its source, and with
``--overwrite`` only an earlier export.

An export is written into a temporary sibling of OUT and renamed over it at the end, so
``--overwrite`` deletes OUT. Two mistakes would then delete what a user made:

* OUT that contains the checkpoint (``zero3d export RUN/checkpoints/latest RUN --overwrite``
  deleted the whole run: every checkpoint, metrics.jsonl, job.yaml), or OUT inside the
  checkpoint, or OUT the checkpoint itself. Refused with or without ``--overwrite``.
* OUT that is not an earlier export (a run directory, a checkpoints/ directory, a home
  directory). ``--overwrite`` replaces a directory only when it looks like an export: plain
  files only, a ``config.json`` and at least one weights file, and none of the files a run
  or a checkpoint holds.
"""

from __future__ import annotations

from pathlib import Path

from parallel3d.errors import ConfigError

RUN_FILES = ("checkpoint.json", "dcp.json", "latest", "metrics.jsonl", "job.yaml", "summary.json")
"""Files of a training run or a checkpoint: a directory with one of them is never an export."""
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def why_not_an_export(out: Path) -> str | None:
    """None when ``out`` looks like an earlier export; otherwise what it holds that an export does not."""
    entries = list(out.iterdir())
    folders = sorted(p.name + "/" for p in entries if p.is_dir())
    run_files = sorted(p.name for p in entries if p.name in RUN_FILES)
    if folders or run_files:
        shown = folders + run_files
        return f"it holds {', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}"
    configs = (out / "config.json").is_file() or (out / "adapter_config.json").is_file()  # a model or a PEFT adapter
    if not configs or not any(any(out.glob(g)) for g in WEIGHT_PATTERNS):
        return "it has no config.json (or adapter_config.json) with weight files (*.safetensors)"
    return None


def check_output(source: Path, out: Path, overwrite: bool) -> None:
    """Refuse an OUT that would delete or mix with the checkpoint ``source``, or anything but an export."""
    src, dst = source.resolve(), out.resolve()
    if _inside(src, dst):
        where = "is the checkpoint" if src == dst else f"contains the checkpoint {source}"
        raise ConfigError(f"output directory {out} {where}; an export replaces its output directory, so write it "
                          "to a directory outside the run (such as a new sibling of it)")
    if _inside(dst, src):
        raise ConfigError(f"output directory {out} lies inside the checkpoint {source}; write the export to a "
                          "directory outside it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} is a file; give the directory to write (a new or an empty one)")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"output directory {out} is not empty (pass --overwrite to replace it)")
    reason = why_not_an_export(out)
    if reason is not None:
        raise ConfigError("--overwrite replaces only an earlier export (plain files: config.json or "
                          f"adapter_config.json and weights), and {out} is not one: {reason}; give a new or empty "
                          "directory, or remove it yourself")
