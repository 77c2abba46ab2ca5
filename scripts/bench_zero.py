"""Zero3D ZeRO stages 0-3 against DDP, FSDP2 and DeepSpeed, on one model, in one invocation.

    torchrun --nproc-per-node 2 scripts/bench_zero.py [--model A|B] [--steps N] [--rounds R]
                                                      [--only ddp,fsdp2,ds1,ds2,ds3,z0,z1,z2,z3]

(``python scripts/bench_zero.py --nproc 2 ...`` does the same.) The process started here is
only a driver: on rank 0 it launches every runner as its own ``torchrun`` job, so each
runner starts from a fresh process and its peak RSS is its own. Runners are interleaved
and repeated for ``--rounds`` rounds (odd rounds in reverse order) to spread the noise of a
shared machine over all of them; step times are pooled over rounds and the median is
reported. See docs/benchmarks.md for how to read the table, and scripts/bench_runners.py for
what each runner does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

ALL = ["ddp", "fsdp2", "ds1", "ds2", "ds3", "z0", "z1", "z2", "z3"]
# pp 2 x dp world/2, 1F1B (run with --nproc 4): ZeRO inside pipelines, and with full gradients kept
PIPELINE = [f"z{s}-pp2" for s in range(4)] + ["z2-pp2-full", "z3-pp2-full"]
# hybrid sharding in groups of 2 (run with --nproc 4) and ZeRO++'s int8 collectives
ZERO_OPTIONS = [f"z{s}-mics2" for s in (1, 2, 3)] + ["z3-qwz-qgz"]
LABEL = {"ddp": "DDP", "fsdp2": "FSDP2", "ds1": "DeepSpeed Z1", "ds2": "DeepSpeed Z2", "ds3": "DeepSpeed Z3",
         **{f"z{s}": f"Zero3D Z{s}" for s in range(4)},
         **{f"z{s}-pp2": f"Zero3D Z{s} pp2" for s in range(4)},
         **{f"z{s}-pp2-full": f"Zero3D Z{s} pp2 full grads" for s in (2, 3)},
         **{f"z{s}-mics2": f"Zero3D Z{s} 2 x 2 hybrid" for s in (1, 2, 3)}, "z3-qwz-qgz": "Zero3D Z3 int8 qwZ+qgZ"}
# Set by torchrun in the driver's own environment; a child job must not inherit them.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="A", help="A: speed (13.7M params), B: memory (134M), L: 254M; "
                                                 "NAME@SEQ sets the sequence length (A@512)")
    ap.add_argument("--steps", type=int, help="timed steps per run (default: model's)")
    ap.add_argument("--warmup", type=int, help="untimed steps before them (default: model's)")
    ap.add_argument("--rounds", type=int, default=2, help="times every runner is run, interleaved")
    ap.add_argument("--only", default=",".join(ALL), help="comma-separated runners, of: " + ",".join(ALL + PIPELINE + ZERO_OPTIONS))
    ap.add_argument("--interleave", action="store_true",
                    help="time all runners in one job, taking steps in turn (same load for all; no memory)")
    ap.add_argument("--nproc", type=int, help="ranks per runner (default: torchrun's world size, else 2)")
    ap.add_argument("--json", help="also write every run's raw result (one JSON line each) here")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds before a runner job is killed")
    ap.add_argument("--bucket-mb", type=float, help="reduce/gather bucket size of every runner in MB (default 25; "
                                                    "ZeRO-2's gradients in flight are a few buckets)")
    ap.add_argument("--runner", help=argparse.SUPPRESS)  # internal: run one runner (under torchrun)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- driver --------------------------------------------------------------------------------


def child_env(nproc: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def launch(name: str, args, nproc: int, out: str, log: str, script: str = __file__) -> bool:
    """Run runner(s) ``name`` as one ``torchrun`` job of ``script`` (this one, or another
    benchmark with the same ``--runner/--model/--out/--steps/--warmup`` arguments)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(script), "--runner", name, "--model", args.model, "--out", out]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.warmup is not None:
        cmd += ["--warmup", str(args.warmup)]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=child_env(nproc), stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        print(f"!! {name} failed ({rc}); last lines of {log}:\n{tail}", flush=True)
    return rc == 0


def collect(results: list[dict], names: list[str] | None = None) -> dict[str, dict]:
    """Per runner: pooled median step time, round medians, peak RSS (max over ranks, median over rounds)."""
    out: dict[str, dict] = {}
    for name in names or ALL + PIPELINE + ZERO_OPTIONS:
        runs = [r for r in results if r["runner"] == name]
        if not runs:
            continue
        mib = lambda key: statistics.median(max(r[key]) / 1024 for r in runs) if runs[0][key] else None  # noqa: E731
        out[name] = {
            "median_s": statistics.median([t for r in runs for t in r["step_s"]]),
            "round_medians": [r["median_s"] for r in runs],
            "min_s": min(t for r in runs for t in r["step_s"]),
            "cpu_s": statistics.median([t for r in runs for t in r["cpu_s"]]),
            "peak_mib": mib("peak_kib"),
            "train_peak_mib": mib("train_peak_kib"),
            "state_mib": max(runs[0]["model_state_bytes"]) / 2**20 if runs[0]["model_state_bytes"] else None,
            "params": runs[0]["params"],
        }
    return out


STATS = ("median_s", "min_s", "cpu_s")


def ratios(stats: dict, a: str, b: str) -> list[float] | None:
    """``a``'s median, min and cpu step time over ``b``'s (None if either did not run)."""
    return [stats[a][k] / stats[b][k] for k in STATS] if a in stats and b in stats else None


def peers(name: str) -> list[str]:
    """What a runner is compared with: DDP; FSDP2 at stage 3; DeepSpeed at the same stage
    (pipeline runners: with each other, by memory, in docs/benchmarks.md)."""
    if "-pp" in name:
        return []
    stage = name[-1] if name[-1].isdigit() else ""
    return ["ddp"] + (["fsdp2"] if stage == "3" or name == "fsdp2" else []) + (
        [f"ds{stage}"] if name.startswith("z") and stage in "123" else [])


def print_tables(stats: dict) -> None:
    mib = lambda v: f"{v:.0f}" if v is not None else "-"  # noqa: E731
    fmt = "{:<26} {:>8} {:>20} {:>7} {:>7}   {:>9} {:>9} {:>9}"
    print(fmt.format("runner", "median s", "round medians", "min s", "cpu s", "peak MiB", "train MiB", "state MiB"))
    for name, s in stats.items():
        print(fmt.format(LABEL[name], f"{s['median_s']:.3f}", " ".join(f"{m:.3f}" for m in s["round_medians"]),
                         f"{s['min_s']:.3f}", f"{s['cpu_s']:.3f}", mib(s["peak_mib"]), mib(s["train_peak_mib"]),
                         mib(s["state_mib"])))
    print("\nratios of step time, each as median / min / cpu (lower is better):")
    fmt = "{:<26} {:>21} {:>21} {:>21}"
    print(fmt.format("runner", "vs DDP", "vs FSDP2", "vs DeepSpeed (same Z)"))
    for name in stats:
        cells = {p: ratios(stats, name, p) for p in peers(name)}
        cell = lambda p: " / ".join(f"{x:.3f}" for x in cells[p]) if cells.get(p) else ""  # noqa: E731
        ds = next((p for p in cells if p.startswith("ds")), None)
        print(fmt.format(LABEL[name], cell("ddp"), cell("fsdp2"), cell(ds) if ds else ""))


def check_targets(stats: dict, model: str) -> None:
    """The product's targets (docs/benchmarks.md), judged on median wall time; each is
    skipped if a runner is missing. The min and cpu ratios are shown alongside."""
    checks = []
    for s, limit in ((1, 1.05), (2, 1.05), (3, 1.15)):
        checks.append((f"Zero3D Z{s} step <= {limit}x DDP", ratios(stats, f"z{s}", "ddp"), limit))
    checks.append(("Zero3D Z3 step <= 0.95x FSDP2", ratios(stats, "z3", "fsdp2"), 0.95))
    for s in (1, 2, 3):
        checks.append((f"Zero3D Z{s} step < DeepSpeed Z{s}", ratios(stats, f"z{s}", f"ds{s}"), 1.0))
    for what, r, limit in checks:
        if r:
            ok = r[0] < limit if limit == 1.0 else r[0] <= limit
            print(f"  [{'met ' if ok else 'MISS'}] {what}: {r[0]:.3f}  (min {r[1]:.3f}, cpu {r[2]:.3f})")
    if model == "B":
        for peer in ("fsdp2", "ds3"):
            for key in ("peak_mib", "train_peak_mib"):
                z, p = stats.get("z3", {}).get(key), stats.get(peer, {}).get(key)
                if z and p:
                    print(f"  [{'met ' if z < p else 'MISS'}] Zero3D Z3 {key} < {LABEL[peer]}: {z:.0f} vs {p:.0f} MiB")


def print_header(args, r0: dict, wall_s: float, load0: float) -> None:
    spec, malloc = r0["spec"], os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset (glibc default)")
    how = ", interleaved step by step in one job" if args.interleave else ""
    print(f"\nModel {args.model}: Llama {r0['params'] / 1e6:.1f}M params, micro-batch {spec['micro']} x "
          f"{spec['seq']} tokens per rank, dp {r0['world']}, fp32 AdamW, clip 1.0; {len(r0['step_s'])} timed "
          f"steps x {args.rounds} rounds per runner{how}; {wall_s:.0f}s wall")
    print(f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; {os.cpu_count()} CPUs; "
          f"torch {r0['torch']}; MALLOC_MMAP_THRESHOLD_={malloc}; buckets "
          f"{os.environ.get('ZERO3D_BENCH_BUCKET_MB', '25')} MB")
    print("median s: over all timed steps of all rounds (slowest rank per step); min s: fastest such step; "
          "cpu s: median CPU seconds of the busiest rank per step")
    print("peak MiB: VmHWM of the whole process (setup included); train MiB: VmHWM over the training "
          "steps only; state MiB: Zero3D memory_report(); all max over ranks, median over rounds\n")


def drive(args) -> None:
    nproc = args.nproc or int(os.environ.get("WORLD_SIZE", 2))
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(ALL + PIPELINE + ZERO_OPTIONS)
    if unknown:
        sys.exit(f"unknown runners {sorted(unknown)}; choose from {ALL + PIPELINE + ZERO_OPTIONS}")
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="bench_zero_")
    out = os.path.join(tmp, "results.jsonl")
    print(f"model {args.model}, {nproc} ranks, {args.rounds} rounds, logs in {tmp}; "
          f"load average {load0[0]:.2f}", flush=True)
    start = time.time()
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in [",".join(order)] if args.interleave else order:
            t = time.time()
            ok = launch(name, args, nproc, out, os.path.join(tmp, f"{name[:20]}.r{rnd}.log"))
            print(f"  round {rnd} {name:<6} {'ok' if ok else 'FAILED'} in {time.time() - t:.0f}s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    results = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    if not results:
        sys.exit("no runner finished")
    stats = collect(results)
    print_header(args, results[0], time.time() - start, load0[0])
    print_tables(stats)
    print("\ntargets:")
    check_targets(stats, args.model)


def main() -> None:
    args = parse_args()
    if args.runner:
        from bench_runners import model_spec, run

        spec = model_spec(args.model)
        run(args.runner.split(","), args.model, args.steps or spec.steps,
            spec.warmup if args.warmup is None else args.warmup, args.out)
    elif int(os.environ.get("RANK", 0)) == 0:
        if args.bucket_mb is not None:  # read by bench_runners in every runner job
            os.environ["ZERO3D_BENCH_BUCKET_MB"] = str(args.bucket_mb)
        drive(args)
    # Other torchrun ranks of the driver have nothing to do.


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
