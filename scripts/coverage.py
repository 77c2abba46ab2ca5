"""Which causal-LM types of the installed transformers train under ZeRO-3, tp 2 and pp 2.

    nice python scripts/coverage.py [model_type ...]          # default: every causal-LM type
    python scripts/coverage.py --shard 1/2                    # every second pending type (run 0/2 beside it)
    python scripts/coverage.py --layouts tp2 deepseek_v2      # only some layouts (the others' results stay)
    python scripts/coverage.py --table                        # README table and counts from the results
    python scripts/coverage.py --composed                     # pp x tp, pp x dp and tp x dp on four ranks
    python scripts/coverage.py --composed --table             # README's table of those
    python scripts/coverage.py --meta [--composed]            # the engine's model built on the meta device
    python scripts/coverage.py --resume [--composed] [--meta] # a checkpoint of one layout resumed under another
    python scripts/coverage.py --more [--composed]            # sequence parallelism; ZeRO-2 inside pipelines

Each type runs under three layouts on two gloo ranks against one process
(``scripts/coverage_check.py`` says how), or with ``--composed`` under three layouts of two axes
on four ranks (results in ``docs/coverage_composed.jsonl``, their own README table); with
``--meta`` the engine's model starts on the meta device, and with ``--resume`` a checkpoint saved
after the first step under one layout is resumed under another (``docs/coverage_resume.jsonl``
and so on: each option adds to the file's name); each outcome is ``pass``, ``refused: <reason>``,
``fail: <what>`` or ``skip: <why>``. Results are appended, one JSON line per type, to
``docs/coverage.jsonl`` as each type finishes, so a run can be stopped and started again (types
already there are skipped unless named or ``--redo``), and several runs (``--shard K/N``, each
its own port) can share the file. Two worker processes serve many types (imports cost seconds);
a type that gives no result within ``--timeout`` seconds (a hang, a crash) is recorded as
``fail`` and the workers are started afresh. Each line records the transformers version; a type
last recorded under another version than the installed one is pending again, and the table
marks its row with that version until it is run. ``--table`` writes the table between the markers
in README.md and prints the counts per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from coverage_check import COMPOSED, COMPOSED_RESUMES, LAYOUTS, MORE, MORE_COMPOSED, RESUMES, SHAPES, check  # noqa: E402

RESULTS = ROOT / "docs" / "coverage.jsonl"
README = ROOT / "README.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
RESTART_EVERY = 25  # types per pair of workers (each initialize builds process groups)


def worker(rank: int, world: int, port: int, jobs: Any, results: Any, layouts: tuple[str, ...], meta: bool,
           scratch: str) -> None:
    """One of ``world`` ranks: for each type from ``jobs``, every layout; rank 0 reports the agreed outcomes."""
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    parent = os.getppid()
    while (model_type := _next_job(jobs, parent)) is not None:
        outcomes = {}
        for layout in layouts:
            mine = check(model_type, layout, meta, scratch)
            every: list[str] = [""] * world
            dist.all_gather_object(every, mine)
            outcomes[layout] = agree(every)
        if rank == 0:
            results.put((model_type, outcomes))
    dist.destroy_process_group()


def _next_job(jobs: Any, parent: int) -> str | None:
    """The next type, or None when told to stop or when the driver is gone."""
    while True:
        try:
            return jobs.get(timeout=30)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def agree(outcomes: list[str]) -> str:
    """One outcome from the ranks': the first failure, refusal or skip, else pass."""
    for kind in ("fail", "refused", "skip"):
        for text in outcomes:
            if text.startswith(kind):
                return text
    return "pass"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """One worker process per rank of the layouts (all of the same size), and their queues."""

    def __init__(self, layouts: tuple[str, ...], meta: bool, scratch: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = free_port()
        world = SHAPES[layouts[0].split(">")[0]].world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=worker, args=(r, world, port, self.jobs[r], self.results, layouts, meta, scratch),
                                 daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.served = 0

    def run(self, model_type: str, timeout: float) -> dict[str, str] | None:
        for q in self.jobs:
            q.put(model_type)
        self.served += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got_type, outcomes = self.results.get(timeout=5)
            except queue.Empty:
                if not all(p.is_alive() for p in self.procs):
                    return None
                continue
            if got_type == model_type:
                return outcomes
        return None

    def stop(self, kill: bool = False) -> None:
        for q, p in zip(self.jobs, self.procs):
            if kill:
                p.kill()
            else:
                q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def load(path: Path) -> dict[str, dict[str, str]]:
    """The last recorded outcome per type and layout (a later line for some layouts keeps the
    others); a type last recorded under another transformers version than the installed one
    carries it under ``"transformers"``."""
    import transformers

    out: dict[str, dict[str, str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                outcomes = out.setdefault(record["type"], {})
                outcomes.pop("transformers", None)
                outcomes.update(record["outcomes"])
                version = record.get("transformers")
                if version and version != transformers.__version__:
                    outcomes["transformers"] = version
    return out


def append(path: Path, model_type: str, outcomes: dict[str, str], seconds: float) -> None:
    """One line, written at once (O_APPEND): runs sharing the file do not interleave lines."""
    import transformers

    line = json.dumps({"type": model_type, "outcomes": outcomes, "seconds": round(seconds, 1),
                       "transformers": transformers.__version__}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run(types: list[str], out: Path, timeout: float, layouts: tuple[str, ...] = LAYOUTS, meta: bool = False) -> None:
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix="zero3d-coverage-")  # resumed layouts' checkpoints
    workers = Workers(layouts, meta, scratch)
    try:
        for model_type in types:
            if workers.served >= RESTART_EVERY:
                workers.stop()
                workers = Workers(layouts, meta, scratch)
            start = time.monotonic()
            outcomes = workers.run(model_type, timeout)
            if outcomes is None:
                outcomes = {layout: f"fail: no result within {timeout:.0f} s (a hang or a crash)" for layout in layouts}
                workers.stop(kill=True)
                workers = Workers(layouts, meta, scratch)
            append(out, model_type, outcomes, time.monotonic() - start)
            print(f"{model_type:28s} " + " | ".join(f"{k}: {v[:70]}" for k, v in outcomes.items()), flush=True)
    finally:
        workers.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the workers on the way out
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type not yet recorded)")
    parser.add_argument("--out", type=Path, help=f"results (default docs/{RESULTS.name}; each of --meta, --resume, --more "
                        "and --composed adds to the name: docs/coverage_meta_resume_composed.jsonl)")
    parser.add_argument("--composed", action="store_true", help=f"the four-rank layouts: {', '.join(COMPOSED)}")
    parser.add_argument("--meta", action="store_true", help="build the engine's model on the meta device")
    parser.add_argument("--resume", action="store_true", help="save under one layout, resume under another: "
                        f"{', '.join(RESUMES)}; with --composed {', '.join(COMPOSED_RESUMES)}")
    parser.add_argument("--more", action="store_true", help=f"further layouts: {', '.join(MORE)}; with --composed "
                        f"{', '.join(MORE_COMPOSED)} (not with --resume)")
    parser.add_argument("--redo", action="store_true", help="run types already recorded again")
    parser.add_argument("--shard", default="0/1", help="K/N: only every N-th pending type, from the K-th")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a type may take")
    parser.add_argument("--layouts", help="comma-separated, of one run's kind (default: all of them): "
                        f"{', '.join(LAYOUTS)}; with --composed {', '.join(COMPOSED)}")
    parser.add_argument("--table", action="store_true", help="write README's table from the results and stop")
    args = parser.parse_args()
    if args.more and args.resume:
        parser.error("--more and --resume: the further layouts are not resumed (the resumed ones are fixed pairs)")
    if args.more:
        known = MORE_COMPOSED if args.composed else MORE
    else:
        known = ((COMPOSED_RESUMES if args.resume else COMPOSED) if args.composed
                 else (RESUMES if args.resume else LAYOUTS))
    options = [o for o in ("meta", "resume", "more", "composed") if getattr(args, o)]
    out = args.out or ROOT / "docs" / ("coverage" + "".join(f"_{o}" for o in options) + ".jsonl")
    if args.table:
        from coverage_table import write_composed_table, write_table

        if options:  # README's markers are named after the results file
            marker = out.stem.replace("_", "-")
            write_composed_table(load(out), README, f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", known,
                                 " ".join(f"--{o}" for o in options))
        else:
            write_table(load(out), README, BEGIN, END, all_types())
        return
    done = load(out)
    types = args.types or [t for t in all_types() if args.redo or t not in done or "transformers" in done[t]]
    k, n = (int(x) for x in args.shard.split("/"))
    layouts = tuple(args.layouts.split(",")) if args.layouts else known
    if not layouts or set(layouts) - set(known):
        parser.error(f"--layouts {args.layouts!r}: expected a comma-separated list of {', '.join(known)}"
                     + ("" if args.composed else " (the four-rank layouts need --composed)"))
    run(types[k::n], out, args.timeout, layouts, args.meta)


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
