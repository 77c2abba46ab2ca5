"""Where a start-up runner's added memory goes: RSS per phase of build + ``initialize``, per rank.

    python scripts/bench_init_phases.py --model B --only z3-meta,fsdp2-meta   # 4 ranks

Runs ``scripts/bench_init.py``'s runners unchanged (same baseline: after the imports, peak
reset), with the functions named in ``PHASES`` wrapped to read ``/proc/self/status`` as they
start and end. For each runner it prints rank 0's table: RSS, peak RSS (VmHWM), and RSS split
into anonymous memory (heap, tensors: ``RssAnon``) and file-backed pages (shared-library code
touched for the first time: ``RssFile``), each as MiB above the baseline; then every rank's
final peak. Python-level nesting shows as nested phases (``> name`` ... ``< name``).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_init  # noqa: E402
from bench_launch import launch as launch_runner, runner_parser  # noqa: E402

# (module, attribute): the phases of Zero3D's initialize and of the FSDP2 runner
PHASES = [
    ("parallel3d.initialize", "_validate"), ("parallel3d.initialize", "resolve_auto"),
    ("parallel3d.initialize", "agree"), ("models.materialize.InitReplay", "_record"),
    ("parallel3d.initialize", "detach_from_meta"), ("parallel3d.initialize", "build_mesh"),
    ("parallel3d.initialize", "apply_tp"), ("parallel3d.initialize", "apply_pipeline"),
    ("parallel3d.initialize", "apply_zero"), ("models.materialize.InitReplay", "fill"),
    ("parallel3d.initialize", "Engine"), ("torch.nn.Module", "to_empty"),
]
RUNNERS = ["z3-meta", "fsdp2-meta", "pp2tp2-meta"]
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def _status() -> dict[str, float]:
    with open("/proc/self/status") as f:
        text = f.read()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) / 1024 for k in FIELDS}


class Marks:
    """``(label, /proc/self/status fields)`` in the order the phases start and end."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict[str, float]]] = []

    def mark(self, label: str) -> None:
        self.rows.append((label, _status()))

    def wrap(self, owner, name: str) -> None:
        inner: Callable = getattr(owner, name)

        @functools.wraps(inner)
        def phase(*args, **kwargs):
            self.mark(f"> {name}")
            try:
                return inner(*args, **kwargs)
            finally:
                self.mark(f"< {name}")

        setattr(owner, name, phase)


def _owner(dotted: str):
    """A module, or a class inside one (``models.materialize.InitReplay``)."""
    try:
        return sys.modules.get(dotted) or importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, cls = dotted.rpartition(".")
        return getattr(importlib.import_module(module), cls)


def run_runner(name: str, model: str, directory: str | None, out: str) -> None:
    """bench_init's runner, with the baseline and every phase marked."""
    import torch.distributed as dist

    marks = Marks()
    if name == "fsdp2-meta":
        import torch.distributed.fsdp as fsdp

        marks.wrap(_owner("torch.nn.Module"), "to_empty")
        marks.wrap(fsdp, "fully_shard")
    else:  # bench_init imports parallel3d before its baseline too
        for module, attr in PHASES[:-1]:
            marks.wrap(_owner(module), attr)
    reset = bench_init._reset_peak

    def reset_and_mark() -> None:
        reset()
        marks.mark("baseline")

    bench_init._reset_peak = reset_and_mark
    destroy = dist.destroy_process_group

    def finish() -> None:
        marks.mark("end")
        base = marks.rows[0][1]
        rows = [(label, {k: v - base[k] for k, v in values.items()}) for label, values in marks.rows]
        with open(f"{out}.rank{dist.get_rank()}", "w") as f:
            json.dump(rows, f)
        destroy()

    dist.destroy_process_group = finish
    bench_init.run_runner(name, model, directory, out)


def _print(name: str, out: str, nproc: int) -> None:
    tables = [json.load(open(f"{out}.rank{r}")) for r in range(nproc)]
    print(f"\n{name}: MiB above the baseline, rank 0")
    print(f"{'phase':<28}" + "".join(f"{k:>9}" for k in FIELDS))
    for label, values in tables[0]:
        if not label.startswith("> fully_shard") and not label.startswith("< fully_shard"):
            print(f"{label:<28}" + "".join(f"{values[k]:9.1f}" for k in FIELDS))
    print("peak (VmHWM) per rank: " + ", ".join(f"{t[-1][1]['VmHWM']:.1f}" for t in tables))


def main(argv=None) -> None:
    ap = runner_parser(__doc__, RUNNERS, "B", sorted(bench_init.MODELS), 4)
    args = ap.parse_args(argv)
    if args.runner:
        return run_runner(args.runner, args.model, args.dir, args.out)
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in args.only.split(",") if n]:
            out = os.path.join(tmp, f"{name}.jsonl")
            if launch_runner(__file__, name, args.nproc, ["--model", args.model, "--dir", tmp, "--out", out], args.timeout):
                _print(name, out, args.nproc)


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
