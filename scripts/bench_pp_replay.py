"""Pipeline parallelism against its peers at pp 4, by CPU replay: Zero3D's schedules,
torch.distributed.pipelining's and DeepSpeed's PipelineEngine on the same split.

    python scripts/bench_pp_replay.py [--model P] [--microbatches 8] [--steps 5] [--warmup 2]
        [--only zgpipe,z1f1b,zi1f1b,zzbh1,tgpipe,t1f1b,ti1f1b,tizb,dspipe] [--json out.json]

Four pipeline ranks on a machine with fewer cores cannot be timed by the wall clock: ranks
share cores, an idle rank gives its core away and a descheduled one delays its neighbours.
So, as ``bench_pipeline.py`` does for Zero3D alone, every runner's step is *replayed* as if
each rank had its own core. Inside one ``torchrun`` job of four ranks (dp 1), every runner
takes its steps in turn (order reversed every step); each compute action (F, B, W of one
micro-batch on one stage) is recorded with its thread CPU time, and so is the CPU each rank
spends between actions (the executor's own work: bookkeeping, posting sends and receives,
the loss's bookkeeping) and before the first and after the last (batch splitting, gradient
clipping, the optimizer step). The replay runs each rank's actions in its recorded order,
each one starting when its rank has done the CPU work before it and its cross-rank input
exists (F after the previous stage's F of that micro-batch, B after the next stage's B);
p2p is free and instant. The replayed step is the replayed pipeline span plus the slowest
rank's CPU after its last action (the gradient-norm all-reduce makes every rank wait for the
last one). What each implementation records:

* Zero3D: its executor's own timeline (``pipeline.record_timeline``), with a clock that
  samples thread CPU beside wall time (``bench_pipeline.DualClock``).
* torch.distributed.pipelining: ``forward_one_chunk`` (with the loss computed after it, which
  belongs to the last stage's forward), ``backward_one_chunk`` (B; input gradients only
  where the schedule splits the weight pass), ``backward_weight_one_chunk`` (W), wrapped.
* DeepSpeed: its ``ForwardPass`` and ``BackwardPass`` instructions, wrapped; the micro-batch
  is the count of each on a stage (its TrainSchedule runs them in micro-batch order).

Runners (fp32 AdamW, clipping 1.0 over all stages, ZeRO 1 where there is ZeRO): Zero3D
``gpipe``, ``1f1b``, ``interleaved_1f1b`` (V = 2), ``zb_h1``; torch's ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B`` (V = 2), ``ScheduleInterleavedZeroBubble``
(V = 2: it needs two chunks per rank); DeepSpeed's ``PipelineEngine`` (its TrainSchedule).
The split is Zero3D's ``split_model`` with ``balance="layers"`` for every runner. Rank 0
prints, per runner, the median replayed step and its parts, and the ratio of each Zero3D
schedule to torch's same schedule and to DeepSpeed's engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PP = 4
ZERO3D = {"zgpipe": ("gpipe", 1), "z1f1b": ("1f1b", 1), "zi1f1b": ("interleaved_1f1b", 2), "zzbh1": ("zb_h1", 1)}
TORCH = {"tgpipe": ("ScheduleGPipe", 1), "t1f1b": ("Schedule1F1B", 1), "ti1f1b": ("ScheduleInterleaved1F1B", 2),
         "tizb": ("ScheduleInterleavedZeroBubble", 2)}
NAMES = [*ZERO3D, *TORCH, "dspipe"]
SAME = dict(zip(ZERO3D, TORCH))  # Zero3D's schedule -> torch's (zb_h1 -> InterleavedZeroBubble)


class Recorder:
    """The actions of the step under way on this rank: ``(kind, microbatch, stage, wall0,
    wall1, cpu0, cpu1)``, times from ``time.perf_counter`` and ``time.thread_time``."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.counts: dict[tuple[str, int], int] = {}

    def reset(self) -> None:
        self.events, self.counts = [], {}

    def timed(self, kind: str, microbatch: int | None, stage: int, fn, *args, **kwargs):
        if microbatch is None:  # DeepSpeed: the n-th pass of a kind on a stage is micro-batch n
            microbatch = self.counts.get((kind, stage), 0)
            self.counts[(kind, stage)] = microbatch + 1
        w0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        self.events.append((kind, microbatch, stage, w0, time.perf_counter(), c0, time.thread_time()))
        return out


RECORDER = Recorder()


def instrument_torch() -> None:
    """Wrap torch.distributed.pipelining's per-chunk passes and its loss (process-wide)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    fwd, bwd, wgt = (_PipelineStageBase.forward_one_chunk, _PipelineStageBase.backward_one_chunk,
                     _PipelineStageBase.backward_weight_one_chunk)
    loss = schedules._PipelineSchedule._maybe_compute_loss

    @functools.wraps(fwd)
    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return RECORDER.timed("F", fwd_chunk_id, self.stage_index, fwd, self, fwd_chunk_id, *args, **kwargs)

    @functools.wraps(bwd)
    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return RECORDER.timed("B", bwd_chunk_id, self.stage_index, bwd, self, bwd_chunk_id, *args, **kwargs)

    @functools.wraps(wgt)
    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return RECORDER.timed("W", bwd_chunk_id, self.stage_index, wgt, self, bwd_chunk_id, *args, **kwargs)

    @functools.wraps(loss)
    def maybe_compute_loss(self, stage, output, target_mbs, mb_index, *args, **kwargs):
        if not stage.is_last:
            return loss(self, stage, output, target_mbs, mb_index, *args, **kwargs)
        return RECORDER.timed("L", mb_index, stage.stage_index, loss, self, stage, output, target_mbs, mb_index,
                              *args, **kwargs)

    _PipelineStageBase.forward_one_chunk = forward_one_chunk
    _PipelineStageBase.backward_one_chunk = backward_one_chunk
    _PipelineStageBase.backward_weight_one_chunk = backward_weight_one_chunk
    schedules._PipelineSchedule._maybe_compute_loss = maybe_compute_loss


def instrument_deepspeed(engine) -> None:
    """Wrap this PipelineEngine's forward and backward instructions (its own instruction map)."""
    from deepspeed.runtime.pipe import schedule

    table = dict(engine._INSTRUCTION_MAP)
    for cls, kind in ((schedule.ForwardPass, "F"), (schedule.BackwardPass, "B")):
        fn = table[cls]
        table[cls] = functools.wraps(fn)(
            lambda self, *a, _fn=fn, _kind=kind, **k: RECORDER.timed(_kind, None, self.stage_id, _fn, self, *a, **k))
    engine._INSTRUCTION_MAP = table


def setup(name: str, model, spec, microbatches: int):
    """(step function, how this rank's actions of the last step are read)."""
    from bench_pp_peers import setup_deepspeed_pipeline, setup_torch_pipeline
    from bench_runners import setup_zero3d_pipeline

    if name in ZERO3D:
        schedule, v = ZERO3D[name]
        step, _ = setup_zero3d_pipeline(model, spec, 1, schedule=schedule, virtual_stages=v, balance="layers",
                                        stages=PP, microbatches=microbatches, record_timeline=True)
        return step, functools.partial(zero3d_events, step.engine)
    if name in TORCH:
        schedule, v = TORCH[name]
        step, _ = setup_torch_pipeline(model, spec, 1, schedule=schedule, virtual=v, pp=PP, microbatches=microbatches)
        return step, torch_events
    step, _ = setup_deepspeed_pipeline(model, spec, 1, pp=PP, microbatches=microbatches)
    instrument_deepspeed(step.engine)
    return step, lambda: list(RECORDER.events)


def torch_events() -> list[tuple]:
    """The recorded actions, each loss folded into the forward it follows (same stage and micro-batch)."""
    out, index = [], {}
    for ev in RECORDER.events:
        if ev[0] == "L":
            i = index[(ev[1], ev[2])]
            f = out[i]
            out[i] = (*f[:4], ev[4], f[5], f[6] + (ev[6] - ev[5]))  # its CPU added, its wall end taken
            continue
        if ev[0] == "F":
            index[(ev[1], ev[2])] = len(out)
        out.append(ev)
    return out


CLOCK = None  # bench_pipeline.DualClock, installed as the executor's clock


def zero3d_events(engine) -> list[tuple]:
    """The executor's timeline of the last step with the clock's wall and CPU samples."""
    tl = engine.loop.executor.timeline
    if len(CLOCK.cpu) != 1 + 2 * len(tl):
        raise RuntimeError(f"expected {1 + 2 * len(tl)} clock samples, got {len(CLOCK.cpu)}: the executor's timing "
                           "changed; update bench_pipeline.DualClock")
    return [(iv.kind, iv.microbatch, iv.chunk * PP + iv.rank, CLOCK.wall[1 + 2 * i], CLOCK.wall[2 + 2 * i],
             CLOCK.cpu[1 + 2 * i], CLOCK.cpu[2 + 2 * i]) for i, iv in enumerate(tl)]


def replay(ranks: list[dict]) -> dict:
    """Each rank's recorded step on a dedicated core (see the module docstring).

    ``ranks[r]``: ``{"events": [...], "cpu0", "cpu1"}`` (thread CPU at the step's start and end).
    Returns the replayed step, its pipeline span, the CPU before/between/after the actions per
    rank, and the bubble (1 - compute CPU / (P x span)).
    """
    from bench_pipeline import cross_input  # F after the previous stage's F, B after the next stage's B

    last = max(ev[2] for rank in ranks for ev in rank["events"])
    seqs, head, between, tail, compute = [], [], [], [], []
    for rank in ranks:
        evs = sorted(rank["events"], key=lambda ev: ev[3])
        pre = [evs[0][5] - rank["cpu0"]] + [b[5] - a[6] for a, b in zip(evs, evs[1:])]
        seqs.append([(ev[0], ev[1], ev[2], max(0.0, p), ev[6] - ev[5]) for ev, p in zip(evs, pre)])
        head.append(max(0.0, pre[0]))
        between.append(sum(max(0.0, p) for p in pre[1:]))
        tail.append(max(0.0, rank["cpu1"] - evs[-1][6]))
        compute.append(sum(ev[6] - ev[5] for ev in evs))
    done: dict[tuple, float] = {}
    clock, pos = [0.0] * len(seqs), [0] * len(seqs)
    progress = True
    while progress:
        progress = False
        for r, seq in enumerate(seqs):
            while pos[r] < len(seq):
                kind, mb, stage, pre, cpu = seq[pos[r]]
                dep = cross_input(kind, mb, stage, last)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r] + pre, done.get(dep, 0.0))
                clock[r] = done[(kind, mb, stage)] = start + cpu
                pos[r] += 1
                progress = True
    if any(p < len(s) for p, s in zip(pos, seqs)):
        raise RuntimeError("replay deadlocked: a recorded order breaks a dependency")
    span = max(clock)
    by_kind = {kind: [sum(ev[4] for ev in seq if ev[0] == kind) for seq in seqs] for kind in "FBW"}
    return {"step": span + max(tail), "span": span, "bubble": 1 - sum(compute) / (len(seqs) * span),
            "compute": compute, "by_kind": by_kind, "head": head, "between": between, "tail": tail}


def worker(args) -> None:
    global CLOCK
    import transformers

    import parallel3d.pipeline.executor as executor_mod
    from bench_pipeline import DualClock
    from bench_runners import build_model, model_spec, token_batches

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != PP:
        raise SystemExit(f"run under torchrun --nproc-per-node {PP}")
    rank = dist.get_rank()
    CLOCK = DualClock()
    executor_mod.time = CLOCK  # the executor times its actions with time.perf_counter
    instrument_torch()
    spec = model_spec(args.model)
    if args.layers:
        spec = dataclasses.replace(spec, llama={**spec.llama, "num_hidden_layers": args.layers})
    names = [n for n in args.only.split(",") if n]
    runners = {name: setup(name, build_model(spec), spec, args.microbatches) for name in names}
    ids = token_batches(spec, 0, 1)[0]
    results: dict[str, list] = {name: [] for name in names}
    for i in range(args.warmup + args.steps):
        for name in names if i % 2 == 0 else names[::-1]:
            step, events = runners[name]
            dist.barrier()
            RECORDER.reset()
            CLOCK.cpu.clear()
            CLOCK.wall.clear()
            w0, c0 = time.perf_counter(), time.thread_time()
            step(ids)
            mine = {"events": events(), "cpu0": c0, "cpu1": time.thread_time(), "wall": time.perf_counter() - w0}
            everyone = [None] * PP
            dist.all_gather_object(everyone, mine)
            if rank == 0 and i >= args.warmup:
                res = replay(everyone)
                res["wall"] = max(r["wall"] for r in everyone)
                results[name].append(res)
        if rank == 0:
            print(f"round {i + 1}/{args.warmup + args.steps} done, load average {os.getloadavg()[0]:.2f}",
                  flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    runners.clear()
    dist.barrier()
    dist.destroy_process_group()


def summarize(results: dict[str, list]) -> dict[str, dict]:
    """Per runner, the median over steps of each replayed figure (ms; bubble as a fraction)."""
    out = {}
    for name, steps in results.items():
        med = lambda f: statistics.median(f(s) for s in steps)  # noqa: E731
        out[name] = {"step_ms": 1e3 * med(lambda s: s["step"]), "span_ms": 1e3 * med(lambda s: s["span"]),
                     "bubble": med(lambda s: s["bubble"]), "compute_ms": 1e3 * med(lambda s: max(s["compute"])),
                     "between_ms": 1e3 * med(lambda s: max(s["between"])),
                     "head_ms": 1e3 * med(lambda s: max(s["head"])), "tail_ms": 1e3 * med(lambda s: max(s["tail"])),
                     "wall_ms": 1e3 * med(lambda s: s["wall"]), "steps": len(steps)}
    return out


def report(stats: dict[str, dict]) -> None:
    print("\n| runner | replayed step ms | pipeline span ms | bubble | compute ms (max rank) | CPU between "
          "actions ms | before / after ms | wall ms (shared cores) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in stats.items():
        print(f"| {name} | {s['step_ms']:.1f} | {s['span_ms']:.1f} | {s['bubble']:.3f} | {s['compute_ms']:.1f} | "
              f"{s['between_ms']:.1f} | {s['head_ms']:.1f} / {s['tail_ms']:.1f} | {s['wall_ms']:.0f} |")
    print("\n| Zero3D / peer | replayed step | pipeline span |")
    print("|---|---|---|")
    for z in ZERO3D:
        for peer in (SAME[z], "dspipe"):
            if z in stats and peer in stats:
                print(f"| {z} / {peer} | {stats[z]['step_ms'] / stats[peer]['step_ms']:.3f} | "
                      f"{stats[z]['span_ms'] / stats[peer]['span_ms']:.3f} |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="P", help="a bench_runners model (P: 8 blocks, hidden 256)")
    ap.add_argument("--layers", type=int, help="blocks, in place of the model's (a multiple of 8 for V = 2)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (every schedule)")
    ap.add_argument("--steps", type=int, default=5, help="replayed steps per runner")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", default=",".join(NAMES), help="comma-separated, of: " + ",".join(NAMES))
    ap.add_argument("--json", help="also write the per-step results and the summary here")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    unknown = set(filter(None, args.only.split(","))) - set(NAMES)
    if unknown:
        raise SystemExit(f"unknown runners {sorted(unknown)}; choose from {', '.join(NAMES)}")
    from bench_zero import child_env

    import tempfile

    out = os.path.join(tempfile.mkdtemp(prefix="bench_pp_replay_"), "results.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PP}",
           os.path.abspath(__file__), "--worker", "--out", out, "--model", args.model, "--layers", str(args.layers or 0), "--microbatches",
           str(args.microbatches), "--steps", str(args.steps), "--warmup", str(args.warmup), "--only", args.only]
    env = child_env(PP)
    env["OMP_NUM_THREADS"] = "1"
    print(f"model {args.model}, pp {PP}, {args.microbatches} micro-batches, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.timeout, check=True)
    with open(out) as f:
        results = json.load(f)["results"]
    stats = summarize(results)
    report(stats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": stats, "results": results}, f, indent=1)
    return stats


if __name__ == "__main__":
    main()
