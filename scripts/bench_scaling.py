"""How the cost of each parallelism grows with the model, against DDP on the same two ranks.

    python scripts/bench_scaling.py [--models A,B,L] [--seqs 128,512] [--rounds 1]
                                    [--plot docs/scaling.png] [--json results.jsonl]
    python scripts/bench_scaling.py --from-json run1.jsonl,run2.jsonl --plot docs/scaling.png

For every benchmark model (scripts/bench_runners.py: A 13.7M, B 134M, L 254M params) at every
sequence length, six runners take their steps, each its own ``torchrun`` job over two ranks
with one thread each (the same seeded model, fp32 AdamW), alternating within each round:
DDP (dp 2), Zero3D's ZeRO 1, 2 and 3 at dp 2, tensor parallelism (tp 2, dp 1: both ranks on
the same micro-batch) and pipeline stages (pp 2, dp 1, 1F1B over four micro-batches).
The models' own micro-batches differ (A: 4 sequences, B and L: 1); ``--seqs 128x1,256x1``
gives every model one sequence per micro-batch, so the rows compare equal tokens.

The figure is time per token over DDP's: a runner's median step time divided by the tokens it
trains per step (dp: one micro-batch per rank; tp: one for the pair; pp: four), over the same
for DDP. DDP is the cheapest way to use two ranks when the model fits on one, so each ratio is
what that layout's sharding costs on the same hardware; for tp and pp it also stands in for
the single-rank step (two ranks of DDP do exactly twice the single rank's work per step, with
one all-reduce of the gradients on top). Printed as a table; plotted against the parameter
count, one line per runner and sequence length. The overhead should shrink, not grow, as the
model grows: ZeRO's and tp's communication grows with the parameters (tp's also with the
tokens), compute with parameters x tokens; the pipeline's bubble is a fixed share.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_runners import PIPELINE_MICRO_BATCHES  # noqa: E402
from bench_zero import collect, launch  # noqa: E402

STAGES = ("z1", "z2", "z3", "ztp", "z0-pp2")
LABELS = {"z1": "ZeRO-1", "z2": "ZeRO-2", "z3": "ZeRO-3", "ztp": "tp 2", "z0-pp2": "pp 2"}
# micro-batches trained per step, over the whole job of ``nproc`` ranks
BATCHES = {"ddp": lambda n: n, "z1": lambda n: n, "z2": lambda n: n, "z3": lambda n: n,
           "ztp": lambda n: n // 2, "z0-pp2": lambda n: PIPELINE_MICRO_BATCHES * n // 2}
# tp runs where every tp rank gets the same batch
SCRIPT = {"ztp": os.path.join(HERE, "bench_tp_peers.py")}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="A,B,L", help="benchmark models (comma-separated)")
    ap.add_argument("--seqs", default="128,512",
                    help="sequence lengths (comma-separated); SEQxMICRO also sets the sequences per micro-batch, "
                         "so every model trains the same tokens (128x1,256x1)")
    ap.add_argument("--rounds", type=int, default=1, help="times every runner runs per model and length")
    ap.add_argument("--nproc", type=int, default=2, help="data-parallel ranks")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds before a runner job is killed")
    ap.add_argument("--plot", help="write the plot here (PNG)")
    ap.add_argument("--json", help="also write every run's raw result (one JSON line each) here")
    ap.add_argument("--from-json", help="measure nothing: tabulate and plot the raw results of earlier runs "
                                        "(comma-separated --json files; their rounds are pooled)")
    args = ap.parse_args(argv)
    if args.nproc < 2 or args.nproc % 2:
        ap.error(f"--nproc {args.nproc}: tp 2 and pp 2 need an even number of ranks, 2 or more")
    for path in args.from_json.split(",") if args.from_json else ():
        if not os.path.isfile(path):
            ap.error(f"--from-json {path}: no such file (give the files earlier runs wrote with --json)")
    from bench_runners import model_spec

    for model in args.models.split(","):
        for seq in args.seqs.split(","):
            try:
                model_spec(f"{model}@{seq}")
            except ValueError as err:
                ap.error(str(err))
    return args


def measure(args) -> list[dict]:
    """Every (model, length, round, runner) once; the raw results, each tagged with its model name."""
    results, tmp = [], tempfile.mkdtemp(prefix="bench_scaling_")
    print(f"logs in {tmp}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for model in args.models.split(","):
        for seq in args.seqs.split(","):
            name, out = f"{model}@{seq}", os.path.join(tmp, f"{model}-{seq}.jsonl")
            job = SimpleNamespace(model=name, steps=None, warmup=None, timeout=args.timeout)
            for rnd in range(args.rounds):
                order = ["ddp", *STAGES]
                for runner in order if rnd % 2 == 0 else order[::-1]:
                    t = time.time()
                    log = os.path.join(tmp, f"{model}-{seq}-{runner}.r{rnd}.log")
                    ok = launch(runner, job, args.nproc, out, log, **({"script": SCRIPT[runner]} if runner in SCRIPT else {}))
                    print(f"  {name:<7} round {rnd} {runner:<4} {'ok' if ok else 'FAILED'} in {time.time() - t:.0f}s, "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
            if os.path.exists(out):
                results += [{**json.loads(line), "model": name} for line in open(out)]
    return results


def ratios(results: list[dict], nproc: int) -> list[dict]:
    """One row per model and length: params, tokens per micro-batch, DDP's step, each runner's
    time per token over DDP's."""
    rows = []
    for name in dict.fromkeys(r["model"] for r in results):
        stats = collect([r for r in results if r["model"] == name], ["ddp", *STAGES])
        if "ddp" not in stats:
            continue
        spec = next(r["spec"] for r in results if r["model"] == name)
        per_batch = {s: stats[s]["median_s"] / BATCHES[s](nproc) for s in stats}
        cpu = {s: stats[s]["cpu_s"] / BATCHES[s](nproc) for s in stats}
        rows.append({"model": name, "params": stats["ddp"]["params"], "tokens": spec["micro"] * spec["seq"],
                     "ddp_s": stats["ddp"]["median_s"],
                     **{s: per_batch[s] / per_batch["ddp"] for s in STAGES if s in stats},
                     "cpu": {s: cpu[s] / cpu["ddp"] for s in STAGES if s in stats}})
    return rows


def print_table(rows: list[dict], cpu: bool = False) -> None:
    """Wall-clock ratios, or (``cpu``) the same per token in the busiest rank's CPU seconds, which a
    loaded machine inflates less (but which leave out waits: the pipeline's bubble, a collective's)."""
    fmt = "{:<8} {:>9} {:>7} {:>8}" + " {:>7}" * len(STAGES)
    print(fmt.format("model", "params M", "tokens", "DDP s", *LABELS.values()))
    for r in rows:
        ratio = r["cpu"] if cpu else r
        print(fmt.format(r["model"], f"{r['params'] / 1e6:.1f}", r["tokens"], f"{r['ddp_s']:.3f}",
                         *(f"{ratio[s]:.3f}" if s in ratio else "-" for s in STAGES)))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.0, 4.6))
    for seq, style in zip(dict.fromkeys(r["model"].partition("@")[2] for r in rows), ("-", "--", ":", "-.")):
        mine = sorted((r for r in rows if r["model"].endswith(f"@{seq}")), key=lambda r: r["params"])
        for index, (stage, marker) in enumerate(zip(STAGES, "osD^v")):
            points = [(r["params"] / 1e6, r[stage]) for r in mine if stage in r]
            if points:
                ax.plot(*zip(*points), marker=marker, linestyle=style, color=f"C{index}",
                        label=f"{LABELS[stage]}, seq {seq}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("time per token / DDP's")
    ax.set_title("Zero3D on two ranks against DDP, by model size")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_json:
        results = [json.loads(line) for path in args.from_json.split(",") for line in open(path) if line.strip()]
        args.rounds = max(Counter((r["model"], r["runner"]) for r in results).values(), default=0)
    else:
        results = measure(args)
    if args.json and not args.from_json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    rows = ratios(results, args.nproc)
    if not rows:
        sys.exit("no model finished its DDP run")
    print(f"\n{args.nproc} ranks, fp32 AdamW, time per token over DDP's (median step of {args.rounds} round(s)); "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    print_table(rows)
    print("\nthe same in CPU seconds per token over DDP's (busiest rank)")
    print_table(rows, cpu=True)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
