"""What the fault probe (scripts/fault_probe.py) measures with: a workspace holding one finished
tiny run that each case copies, the real ``zero3d`` CLI run as a user runs it, file checksums
before and after, and the verdict of one case.

A case's verdict has three parts:

* **clear**: no traceback, and exactly one line of what the command printed names the problem
  (holds the case's marker, such as ``error:``, once, and every fragment the case expects);
  log lines (``HH:MM:SS module: ...``) and torchrun's agent lines (``zero3d: worker rank N
  ... exited with code C``) are not counted against it;
* **nothing lost**: every file of the case directory that existed before is there afterwards
  with the same bytes, except the files the case may change (such as ``latest`` when a resume
  goes on) and files that only grew (``metrics.jsonl`` appended to);
* **as expected**: the exit status is the expected one, the message is clear and nothing is lost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from fnmatch import fnmatch
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_train_cli import tiny_job  # noqa: E402 - the suite's tiny job, after ROOT is importable

logger = logging.getLogger("fault_probe")

LOG_LINE = re.compile(r"^(\[rank \d+\] )?\d\d:\d\d:\d\d [\w.]+: ")
AGENT_LINE = re.compile(r"^zero3d: worker rank \d+ \(pid \d+\) ")
BASE_STEPS = 6  # the base run: global_step3 and global_step6, latest global_step6


@dataclasses.dataclass
class Result:
    """One case: what was expected, what happened, and the verdict."""

    category: str
    name: str
    expected: str
    happened: str = ""
    clear: bool | None = None  # None: the case expects no message (it works)
    lost: list[str] = dataclasses.field(default_factory=list)
    as_expected: bool = False
    seconds: float = 0.0
    skipped: str | None = None


@dataclasses.dataclass
class Case:
    category: str
    name: str
    expected: str
    run: Callable[[Workspace, Result], None]


CASES: list[Case] = []


def case(category: str, name: str, expected: str) -> Callable:
    """Register the decorated ``fn(workspace, result)`` as a probe case."""
    def register(fn: Callable[[Workspace, Result], None]) -> Callable:
        CASES.append(Case(category, name, expected, fn))
        return fn
    return register


@dataclasses.dataclass
class Proc:
    rc: int
    out: str
    err: str


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: its relative path -> (sha256, size)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            out[str(p.relative_to(root))] = (hashlib.sha256(data).hexdigest(), len(data))
    return out


def losses(root: Path, before: dict[str, tuple[str, int]], may_change: Sequence[str] = ()) -> list[str]:
    """The files of ``before`` that are gone or changed under ``root`` (not those matching
    ``may_change``, nor those whose old bytes are still their first bytes: appended to)."""
    lost = []
    for rel, (digest, size) in before.items():
        path = root / rel
        if not path.is_file():
            lost.append(f"{rel} deleted")
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == digest or any(fnmatch(rel, pattern) for pattern in may_change):
            continue
        if len(data) > size and hashlib.sha256(data[:size]).hexdigest() == digest:
            continue  # appended to (metrics.jsonl of a run that went on)
        lost.append(f"{rel} changed")
    return lost


def problem_lines(text: str) -> list[str]:
    """What a command said, less its log lines and torchrun's agent's per-worker exit lines."""
    return [line for line in text.splitlines()
            if line.strip() and not LOG_LINE.match(line) and not AGENT_LINE.match(line)]


def is_clear(text: str, says: Sequence[str]) -> bool:
    """No traceback, and exactly one line holds ``says[0]`` (the marker), holding all of ``says``."""
    if "Traceback" in text:
        return False
    marked = [line for line in text.splitlines() if says[0] in line]
    return len(marked) == 1 and all(fragment in marked[0] for fragment in says)


def shorten(text: str, where: Path, limit: int = 240) -> str:
    text = text.replace(str(where), "…")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def judge(result: Result, proc: Proc, where: Path, before: dict, *, rc: int, says: Sequence[str] | None,
          may_change: Sequence[str] = (), extra_lost: Sequence[str] = ()) -> None:
    """Fill ``result`` from a finished command: ``says`` None means it must work and say no error."""
    lines = problem_lines(proc.err)
    marked = [line for line in lines if says and says[0] in line]
    first = (marked or lines or proc.out.strip().splitlines() or ["(nothing)"])[0 if marked or lines else -1]
    result.happened = shorten(f"exit {proc.rc}: {first}" + (f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else ""),
                              where)
    result.lost = losses(where, before, may_change) + list(extra_lost)
    if says is None:
        result.clear = None
        ok = "Traceback" not in proc.err
    else:
        result.clear = ok = is_clear(proc.err, says)
    result.as_expected = proc.rc == rc and ok and not result.lost


class Workspace:
    """The probe's directory: a tokenizer/data cache, one finished base run, one directory per case."""

    def __init__(self, root: Path, python: str = sys.executable) -> None:
        self.root, self.python = root, python
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache = root / "cache"
        self._base: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, ZERO3D_CACHE=str(self.cache), PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu",
                    TOKENIZERS_PARALLELISM="false", **extra)

    def zero3d(self, *args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> Proc:
        """``zero3d ARGS`` as a user runs it (``python -m parallel3d.cli``)."""
        try:
            done = subprocess.run([self.python, "-m", "parallel3d.cli", *args], cwd=cwd, env=env or self.env(),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return Proc(124, exc.stdout or "", f"(timed out after {timeout} s) {exc.stderr or ''}")
        return Proc(done.returncode, done.stdout, done.stderr)

    def write_job(self, run: Path, config: Path, **train) -> Path:
        job = tiny_job(run, max_steps=BASE_STEPS, save_interval=3, keep_last=10, eval_interval=0, progress=False)
        job["train"].update(train)
        config.write_text(yaml.safe_dump(job))
        return config

    def base(self) -> Path:
        """The finished base run (trained once, 2 ranks): checkpoints global_step3 and global_step6."""
        if self._base is None:
            where = self.root / "base"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir()
            config = self.write_job(where / "run", where / "job.yaml")
            start = time.monotonic()
            proc = self.zero3d("train", str(config), "--nproc-per-node", "2", cwd=where)
            if proc.rc != 0:
                raise RuntimeError(f"the base run failed (exit {proc.rc}):\n{proc.err[-3000:]}")
            logger.info("base run: %d steps on 2 ranks in %.1f s", BASE_STEPS, time.monotonic() - start)
            self._base = where / "run"
        return self._base

    def case_dir(self, slug: str) -> Path:
        where = self.root / slug
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        return where

    def copy_run(self, slug: str, **train) -> tuple[Path, Path, Path]:
        """A fresh copy of the base run: (case directory, its job config, the run directory)."""
        where = self.case_dir(slug)
        run = where / "run"
        shutil.copytree(self.base(), run)
        return where, self.write_job(run, where / "job.yaml", **train), run

    def train(self, where: Path, config: Path, *overrides: str, timeout: float = 300) -> Proc:
        return self.zero3d("train", str(config), "--nproc-per-node", "2", *overrides, cwd=where, timeout=timeout)


def complete_checkpoint(tag_dir: Path) -> str | None:
    """None if ``tag_dir`` is a whole checkpoint (manifest, index and every chunk's checksum), else why not."""
    from parallel3d.checkpoint.storage import read_chunk, read_metadata
    from parallel3d.errors import ConfigError
    from parallel3d.job.resume_check import check_complete

    try:
        check_complete(tag_dir)
        md = read_metadata(tag_dir)
        for fqn, tmd in md.state_dict_metadata.items():
            for chunk in tmd.chunks:
                read_chunk(tag_dir, md, fqn, chunk.offsets)
    except ConfigError as exc:
        return str(exc)
    return None


def run_cases(workspace: Workspace, cases: Sequence[Case]) -> list[Result]:
    results = []
    for c in cases:
        result = Result(c.category, c.name, c.expected)
        start = time.monotonic()
        try:
            c.run(workspace, result)
        except Exception as exc:  # noqa: BLE001 - a probe failure is a row, not the end of the probe
            result.happened = f"the probe itself failed: {type(exc).__name__}: {exc}"
            result.as_expected = False
        result.seconds = time.monotonic() - start
        logger.info("%-14s %-58s %s (%.0f s)", c.category, c.name,
                    "skipped" if result.skipped else "ok" if result.as_expected else "NOT AS EXPECTED", result.seconds)
        results.append(result)
    return results
