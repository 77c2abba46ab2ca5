"""Measured pipeline bubbles and live activations of every schedule at P = 4, beside the theory.

    torchrun --standalone --nproc-per-node 4 scripts/bench_pipeline.py
        [--microbatches 8,16] [--warmup 2] [--steps 5] [--schedules gpipe,1f1b,interleaved_1f1b,zb_h1]
        [--out results/pipeline]

P = 4 pipeline stages, dp = 1, gloo on CPU, one torch thread per rank. A random-init Llama
(8 blocks, hidden 256, seq 128, micro-batches of 2 sequences, vocabulary 256 so that the head
and loss do not unbalance the last stage; 2 blocks per stage, 1 per chunk with V = 2) goes
through ``parallel3d.initialize`` once per (schedule, m) with ``pipeline.record_timeline``; all
engines then take their steps in turn (round-robin, so a burst of load on the shared machine
hits every schedule alike). After
``--warmup`` steps, each of ``--steps`` steps is recorded: ``engine.write_timeline`` writes its
Chrome trace, and the step with the median bubble is reported and drawn (``zero3d plot``'s
``plot_timeline``, i.e. ``draw.draw_png``) under ``--out`` (not committed).

Definitions (the same as ``parallel3d.pipeline.simulate``):

* span: earliest start to latest end of any compute action (F, B, W) of the step, over all
  ranks; it excludes the tied-gradient sum, the loss broadcast and the optimizer step.
* busy[r]: summed wall-clock length of rank r's compute actions; waits for receives are idle.
* bubble[r] = 1 - busy[r] / span; overall bubble = 1 - sum(busy) / (P * span).
* live activations of a rank: (micro-batch, chunk) pairs whose F has started and whose B
  (W for zb_h1) has not ended; the peak is ``simulate._peak_live`` of the measured intervals.
* theory: (P-1)/(m+P-1) for gpipe and 1f1b, (P-1)/(V*m+P-1) for interleaved_1f1b,
  (P-1)(F+B-W) / (m(F+B+W) + (P-1)(F+B-W)) for zb_h1 with the measured mean F, B, W of
  ranks 1..P-1 (stage 0 has no input gradient: its B is empty and its W the whole backward).

Time-sharing: with more ranks than cores, ranks share cores. A compute action takes longer in
wall time while its neighbours compute too, and an idle rank gives its core away, which
inflates busy time where the pipeline is full and hides bubbles; a rank descheduled in the
middle of an action delays the ranks waiting for it, which adds idle time. So every action's
thread CPU time (``time.thread_time``; with one torch thread, forward and CPU autograd run in
the calling thread) is taken beside its wall time, by handing the executor a clock that samples
both (its ``time.perf_counter`` calls: one per step, two per action). Reported beside the wall
numbers: ``wall/CPU`` busy per rank (the inflation), the theory with CPU costs, and a *CPU
replay*: the recorded step re-timed as if every rank had its own core (each action lasts its
CPU time, in the recorded order, after its cross-rank input; p2p free), whose bubble is the
schedule's plus the stages' imbalance and the actions' jitter, without time-sharing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

P = 4
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", default="8,16", help="micro-batch counts (comma-separated)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--virtual-stages", type=int, default=2, help="V for interleaved_1f1b")
    ap.add_argument("--warmup", type=int, default=2, help="unreported steps first")
    ap.add_argument("--steps", type=int, default=5, help="recorded steps; the median-bubble one is reported")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--vocab", type=int, default=256, help="small, so the head does not make the last stage heavy")
    ap.add_argument("--zero", type=int, default=1, help="ZeRO stage (0-3)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "pipeline"))
    return ap.parse_args(argv)


class DualClock:
    """Stands in for the executor's ``time`` module: ``perf_counter()`` also samples this
    thread's CPU time, so each recorded action gets a CPU duration beside its wall one; the
    first sample of a step is the executor's t0 (its timeline is relative to it)."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def perf_counter(self) -> float:
        self.cpu.append(time.thread_time())
        self.wall.append(time.perf_counter())
        return self.wall[-1]

    def __getattr__(self, name):
        return getattr(time, name)


def theory(schedule: str, m: int, v: int, f: float, b: float, w: float) -> float:
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (m + P - 1)
    if schedule == "interleaved_1f1b":
        return (P - 1) / (v * m + P - 1)
    idle = (P - 1) * (f + b - w)
    return idle / (m * (f + b + w) + idle)


def make_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=args.seq, attention_dropout=0.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def build(args, schedule: str, m: int):
    import parallel3d

    config = {
        "train_batch_size": args.micro_batch * m,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
        "pipeline": {"stages": P, "schedule": schedule, "balance": "layers", "record_timeline": True,
                     "virtual_stages": args.virtual_stages if schedule == "interleaved_1f1b" else 1},
    }
    engine, _, _, _ = parallel3d.initialize(model=make_model(args), config=config)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(m):
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return engine, batches


def step(engine, batches, clock: DualClock) -> tuple[float, dict]:
    """One train_batch; returns its wall time and this rank's ``{"t0", "actions": [(interval,
    cpu seconds)]}``, the intervals in absolute ``perf_counter`` time (every rank's t0 is its
    own exit from the executor's barrier; absolute times are comparable across the ranks of
    one machine, where perf_counter is the system's monotonic clock)."""
    clock.cpu.clear()
    clock.wall.clear()
    start = time.perf_counter()
    engine.train_batch(iter(batches))
    wall = time.perf_counter() - start
    tl = engine.loop.executor.timeline
    if len(clock.cpu) != 1 + 2 * len(tl):
        raise RuntimeError(f"expected {1 + 2 * len(tl)} clock samples, got {len(clock.cpu)}: the executor's timing "
                           "changed; update DualClock")
    t0 = clock.wall[0]
    cpu = [clock.cpu[2 + 2 * i] - clock.cpu[1 + 2 * i] for i in range(len(tl))]
    return wall, {"t0": t0, "actions": [((*iv[:4], iv.start + t0, iv.end + t0), c) for iv, c in zip(tl, cpu)]}


def cross_input(kind: str, microbatch: int, stage: int, last: int) -> tuple | None:
    """The pass on another stage whose output this pass consumes, as (kind, microbatch, stage)."""
    if kind == "F" and stage > 0:
        return ("F", microbatch, stage - 1)
    if kind == "B" and stage < last:
        return ("B", microbatch, stage + 1)
    return None


def start_gaps(ranks: list[list], v: int) -> list[float]:
    """For every action: start - max(end of the rank's previous action, end of its cross-rank
    input): how long it was ready but not running (p2p transfer, waking the process up,
    executor overhead)."""
    from parallel3d.pipeline import Interval

    last = P * v - 1
    ends = {}
    for r, rank in enumerate(ranks):
        for t, _ in rank:
            iv = Interval(*t)
            ends[(iv.kind, iv.microbatch, iv.chunk * P + r)] = iv.end
    gaps = []
    for r, rank in enumerate(ranks):
        prev = None
        for t, _ in sorted(rank, key=lambda x: x[0][4]):
            iv = Interval(*t)
            dep = cross_input(iv.kind, iv.microbatch, iv.chunk * P + r, last)
            ready = max([e for e in (prev, ends.get(dep)) if e is not None], default=None)
            if ready is not None:
                gaps.append(max(0.0, iv.start - ready))
            prev = iv.end
    return gaps


def replay(ranks: list[list], v: int) -> list:
    """The measured step replayed on dedicated cores: every rank runs its actions in the
    recorded order, each lasting its thread CPU time, starting when the rank is free and its
    input has arrived (F after the previous stage's F, B after the next stage's B; W and a
    rank's own B follow from the order), with free, instant p2p."""
    from parallel3d.pipeline import Interval

    last = P * v - 1
    seqs = [sorted(((Interval(*t), c) for t, c in rank), key=lambda x: x[0].start) for rank in ranks]
    done: dict[tuple, float] = {}
    clock, pos, out = [0.0] * P, [0] * P, []
    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pos[r] < len(seqs[r]):
                iv, cpu = seqs[r][pos[r]]
                stage = iv.chunk * P + r
                need = [d for d in (cross_input(iv.kind, iv.microbatch, stage, last),) if d is not None]
                if any(d not in done for d in need):
                    break
                start = max([clock[r]] + [done[d] for d in need])
                clock[r] = done[(iv.kind, iv.microbatch, stage)] = start + cpu
                out.append(Interval(r, iv.kind, iv.microbatch, iv.chunk, start, start + cpu))
                pos[r] += 1
                progress = True
    if any(pos[r] < len(seqs[r]) for r in range(P)):
        raise RuntimeError("replay deadlocked: the recorded order breaks a dependency")
    return out


def analyse(schedule: str, m: int, v: int, gathered: list[dict], step_wall: float) -> dict:
    """Rank 0: the numbers of one recorded step from every rank's ``step`` result."""
    from parallel3d.pipeline import Costs, Interval, Kind, schedule_table, simulate
    from parallel3d.pipeline.simulate import _peak_live
    from parallel3d.job.plot import timeline_stats

    ranks = [g["actions"] for g in gathered]
    t0s = [g["t0"] for g in gathered]
    ivs = [Interval(*iv) for rank in ranks for iv, _ in rank]
    cpu = [[c for _, c in rank] for rank in ranks]
    stats = timeline_stats(ivs)
    release = Kind.W if schedule == "zb_h1" else Kind.B
    by_rank = [[iv for iv in ivs if iv.rank == r] for r in range(P)]
    chunks = v  # a chunk's pass is 1/V of a rank's: scale to a whole micro-batch through a rank

    # zb_h1's formula is for a stage whose B is the input gradient and W the weight gradient;
    # stage 0 has no input gradient (its B is empty, its W the whole backward), so zb_h1's
    # F, B, W are the means over ranks 1..P-1 (the other schedules' theory ignores costs)
    cost_ranks = range(1, P) if schedule == "zb_h1" else range(P)

    def mean_cost(kind: str, which: str) -> float:
        vals = [(c if which == "cpu" else iv.end - iv.start) for r in cost_ranks for (iv, c) in
                ((Interval(*t), c) for t, c in ranks[r]) if iv.kind == kind]
        return chunks * statistics.mean(vals) if vals else 0.0

    costs = {which: {k: mean_cost(k, which) for k in "FBW"} for which in ("wall", "cpu")}
    rank_cpu_ms = [{k: 1e3 * chunks * statistics.mean([c for t, c in rank if t[1] == k] or [0.0]) for k in "FBW"}
                   for rank in ranks]
    cpu_busy = [sum(c) for c in cpu]
    gaps = start_gaps(ranks, v)
    cpu_timeline = replay(ranks, v)
    cpu_stats = timeline_stats(cpu_timeline)
    what_if = None
    if schedule == "zb_h1":
        # Stage 0 has no input gradient, so its B is empty and its W the whole backward: the
        # replay again, with rank 0's B and W lasting rank 1's mean B and W (an even split).
        mean1 = {k: statistics.mean([c for t, c in ranks[1] if t[1] == k]) for k in "BW"}
        even = [[(t, mean1[t[1]] if t[1] in mean1 else c) for t, c in ranks[0]]] + ranks[1:]
        what_if = timeline_stats(replay(even, v)).bubble_fraction
    sim = simulate(schedule_table(schedule, P, m, v), Costs(1, 1, 1))
    return {
        "schedule": schedule, "m": m, "v": v, "span_s": stats.span, "step_s": step_wall,
        "bubble": stats.bubble_fraction, "bubble_per_rank": stats.bubble,
        "theory": theory(schedule, m, v, *(costs["wall"][k] for k in "FBW")),
        "theory_cpu_costs": theory(schedule, m, v, *(costs["cpu"][k] for k in "FBW")),
        "t0_skew_s": max(t0s) - min(t0s), "gap_median_s": statistics.median(gaps),
        "gap_mean_s": statistics.mean(gaps), "gap_fraction": sum(gaps) / (P * stats.span),
        "busy_s": stats.busy, "cpu_busy_s": cpu_busy,
        "wall_over_cpu": [b / c if c else float("nan") for b, c in zip(stats.busy, cpu_busy)],
        "cpu_replay_bubble": cpu_stats.bubble_fraction, "cpu_replay_bubble_per_rank": cpu_stats.bubble,
        "cpu_replay_span_s": cpu_stats.span, "cpu_replay_bubble_rank0_split_like_rank1": what_if,
        "cpu_timeline": [tuple(iv) for iv in cpu_timeline],
        "costs_ms": {w: {k: 1e3 * x for k, x in c.items()} for w, c in costs.items()},
        "cpu_costs_ms_per_rank": rank_cpu_ms,
        "peak_live": [_peak_live(rank, release) for rank in by_rank],
        "peak_live_sim": sim.peak_live,
    }


def fmt_list(xs, f="{:.2f}") -> str:
    return ", ".join(f.format(x) for x in xs)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    import parallel3d.pipeline.executor as executor_mod
    from parallel3d.pipeline import Interval
    from parallel3d.pipeline.draw import draw_png
    from parallel3d.job.plot import plot_timeline

    transformers.logging.set_verbosity_error()
    clock = DualClock()
    executor_mod.time = clock  # the executor times its actions with time.perf_counter
    ms = [int(x) for x in args.microbatches.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    runs = []
    for m in ms:
        for s in schedules:
            engine, batches = build(args, s, m)
            runs.append({"schedule": s, "m": m, "v": args.virtual_stages if s == "interleaved_1f1b" else 1,
                         "engine": engine, "batches": batches, "steps": []})
    if dist.get_world_size() != P or runs[0]["engine"].mesh.dp != 1:
        raise SystemExit(f"run with torchrun --nproc-per-node {P} (P = {P}, dp = 1)")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"P={P}, dp=1, {os.cpu_count()} CPUs, torch threads/rank {torch.get_num_threads()}, "
              f"model: Llama {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, micro-batch "
              f"{args.micro_batch}, vocab {args.vocab}; ZeRO {args.zero}; load average at start "
              f"{fmt_list(os.getloadavg())}", flush=True)
    loads = []
    for i in range(args.warmup + args.steps):
        for run in runs:
            wall, mine = step(run["engine"], run["batches"], clock)
            everyone = [None] * P
            dist.all_gather_object(everyone, mine)
            if i >= args.warmup:
                trace = os.path.join(args.out, f"{run['schedule']}_m{run['m']}_step{i - args.warmup}.json")
                run["engine"].write_timeline(trace)
                if rank == 0:
                    res = analyse(run["schedule"], run["m"], run["v"], everyone, wall)
                    res["trace"] = trace
                    run["steps"].append(res)
        loads.append(os.getloadavg()[0])
        if rank == 0:
            print(f"round {i + 1}/{args.warmup + args.steps} done, load average {loads[-1]:.2f}", flush=True)
    if rank != 0:
        dist.barrier()
        return 0

    results = []
    for run in runs:
        steps = sorted(run["steps"], key=lambda r: r["bubble"])
        res = steps[len(steps) // 2]  # the median step
        res["bubble_all_steps"] = [r["bubble"] for r in run["steps"]]
        res["png"] = str(plot_timeline(res["trace"]))
        name = f"{res['schedule']}_m{res['m']}"
        res["cpu_png"] = str(draw_png([Interval(*iv) for iv in res.pop("cpu_timeline")],
                                      os.path.join(args.out, f"{name}_cpu_replay.png"), time_label="CPU time (s)",
                                      title=f"{name}: CPU-time replay on dedicated cores, bubble "
                                            f"{res['cpu_replay_bubble']:.3f}"))
        results.append(res)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "load_average_1min": loads, "results": results}, f, indent=1)

    print("\n| schedule | m | measured bubble (each step) | theory | per rank | start gaps: median ms, share "
          "of P x span | peak live per rank (sim) | span ms | step ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        name = r["schedule"] + (f" V={r['v']}" if r["v"] > 1 else "")
        print(f"| `{name}` | {r['m']} | {r['bubble']:.3f} ({fmt_list(r['bubble_all_steps'], '{:.3f}')}) | "
              f"{r['theory']:.3f} | {fmt_list(r['bubble_per_rank'])} | {1e3 * r['gap_median_s']:.1f}, "
              f"{r['gap_fraction']:.2f} | {fmt_list(r['peak_live'], '{}')} ({fmt_list(r['peak_live_sim'], '{}')}) | "
              f"{1e3 * r['span_s']:.0f} | {1e3 * r['step_s']:.0f} |")
    print("\nCPU view: wall busy / thread-CPU busy per rank; mean F/B/W per micro-batch through a rank (zb_h1: "
          "ranks 1-3) (wall | CPU ms, and CPU per rank); the step replayed with CPU durations on dedicated "
          "cores (bubble, per rank, span); theory with CPU costs")
    print("| schedule | m | wall/CPU per rank | F/B/W ms wall | F/B/W ms CPU | F/B/W ms CPU per rank | "
          "CPU replay bubble | per rank | replay span ms | theory (CPU costs) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        name = r["schedule"] + (f" V={r['v']}" if r["v"] > 1 else "")
        cw, cc = r["costs_ms"]["wall"], r["costs_ms"]["cpu"]
        print(f"| `{name}` | {r['m']} | {fmt_list(r['wall_over_cpu'])} | "
              f"{cw['F']:.0f}/{cw['B']:.0f}/{cw['W']:.0f} | {cc['F']:.0f}/{cc['B']:.0f}/{cc['W']:.0f} | "
              + ", ".join(f"{c['F']:.0f}/{c['B']:.0f}/{c['W']:.0f}" for c in r["cpu_costs_ms_per_rank"])
              + f" | {r['cpu_replay_bubble']:.3f} | {fmt_list(r['cpu_replay_bubble_per_rank'])} | "
              f"{1e3 * r['cpu_replay_span_s']:.0f} | {r['theory_cpu_costs']:.3f} |")
    for r in results:
        if r["cpu_replay_bubble_rank0_split_like_rank1"] is not None:
            print(f"zb_h1 m={r['m']}: CPU replay with rank 0's B/W lasting rank 1's (an even split on stage 0): "
                  f"bubble {r['cpu_replay_bubble_rank0_split_like_rank1']:.3f}")
    print(f"largest skew of the ranks' t0 (barrier exits): {1e3 * max(r['t0_skew_s'] for r in results):.1f} ms")
    print(f"\nload average (1 min) after each round: {fmt_list(loads)}")
    print(f"traces, PNGs and results.json under {args.out}", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
