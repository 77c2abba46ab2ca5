"""Checkpoint cost: save and load time and bytes written, Zero3D against DeepSpeed and FSDP2 + DCP.

    python scripts/bench_checkpoint.py [--model B] [--nproc 2] [--rounds 3] [--passes 2] [--only z3,ds3,fsdp2]

Each runner is its own ``torchrun --standalone`` job over ``--nproc`` ranks. Every rank builds
the benchmark model (scripts/bench_runners.py), trains one step (so the optimizer holds its
Adam moments), then ``--rounds`` times: barrier, save into a fresh directory, barrier (the
save's time), barrier, load it back, barrier (the load's time). Reported: the median over
rounds of the slowest rank, and the bytes the save wrote. The list of runners runs ``--passes``
times, alternating, with the page cache flushed (``sync``) before each runner, so that one
runner's writeback does not slow the next; the median over passes is reported.

| runner | save / load |
|---|---|
| z3 | Zero3D ZeRO-3: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (mesh-free, DCP, checksummed) |
| z3-async | the same with ``checkpoint.async_save``: *save* is the stall training sees (the copy to CPU);
  *finish* the time ``wait_for_checkpoint`` then waits for the background write |
| ds3 | DeepSpeed ZeRO-3: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (per-rank ``torch.save``) |
| fsdp2 | FSDP2 + DCP: ``get_state_dict`` (model and optimizer) + ``dcp.save`` / ``dcp.load`` + ``set_state_dict`` |

Zero3D and DCP write to the page cache and fsync; DeepSpeed's ``torch.save`` does not fsync,
so its times leave the flush to the kernel.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_launch import launch as launch_runner, runner_parser  # noqa: E402

ALL = ["z3", "z3-async", "ds3", "fsdp2"]

def parse_args(argv=None):
    ap = runner_parser(__doc__, ALL, "B", ["A", "B"], 2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2,
                    help="times the whole list of runners is run, alternating (the median over passes is reported)")
    return ap.parse_args(argv)


def _fsdp2_io(model, spec):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from bench_runners import ADAMW, fsdp2_model

    model = fsdp2_model(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def save(path):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def load(path):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return step, save, load


def _engine_io(engine):
    from bench_runners import engine_step

    return engine_step(engine), lambda path: engine.save_checkpoint(path), lambda path: engine.load_checkpoint(path)


def _zero3d_async(model, spec):
    import parallel3d

    from bench_runners import ds_config

    engine = parallel3d.initialize(model=model, config={**ds_config(spec, 3), "checkpoint": {"async_save": True}})[0]
    step, save, load = _engine_io(engine)
    return step, save, load, engine.wait_for_checkpoint


def run_runner(name: str, model_name: str, rounds: int, directory: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from bench_runners import MODELS, build_model, deepspeed_engine, token_batches, zero3d_engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    spec = MODELS[model_name]
    model = build_model(spec)
    finish = lambda: None  # noqa: E731 - only a background save has something to wait for
    if name == "fsdp2":
        step, save, load = _fsdp2_io(model, spec)
    elif name == "ds3":
        step, save, load = _engine_io(deepspeed_engine(model, spec, 3))
    elif name == "z3-async":
        step, save, load, finish = _zero3d_async(model, spec)
    else:
        step, save, load = _engine_io(zero3d_engine(model, spec, 3))
    step(token_batches(spec, dist.get_rank(), 1)[0])
    times = []
    for r in range(rounds):
        path = os.path.join(directory, f"{name}-{r}")
        row = []
        for action in (save, lambda _: finish(), load):
            dist.barrier()
            t0 = time.perf_counter()
            action(path)
            dist.barrier()
            row.append(time.perf_counter() - t0)
        times.append(row)
    cell = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(cell, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(directory, f"{name}-0"))
                      for f in fs)
        with open(out, "a") as f:
            f.write(json.dumps({"runner": name, "save_s": statistics.median(cell[:, 0].tolist()),
                                "finish_s": statistics.median(cell[:, 1].tolist()),
                                "load_s": statistics.median(cell[:, 2].tolist()), "bytes": written}) + "\n")
        for r in range(rounds):
            shutil.rmtree(os.path.join(directory, f"{name}-{r}"), ignore_errors=True)
    dist.destroy_process_group()


def launch(name: str, args, directory: str, out: str) -> None:
    launch_runner(__file__, name, args.nproc, ["--model", args.model, "--rounds", str(args.rounds), "--dir", directory,
                                               "--out", out], args.timeout, {"DS_ACCELERATOR": "cpu"})


def _median_rows(results) -> dict[str, dict]:
    """Each runner's row: the median of every timing over its passes (bytes from its first)."""
    passes: dict[str, list[dict]] = {}
    for r in results:
        passes.setdefault(r["runner"], []).append(r)
    return {name: {**rs[0], **{key: statistics.median(r[key] for r in rs) for key in ("save_s", "finish_s", "load_s")}}
            for name, rs in passes.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.runner:
        return run_runner(args.runner, args.model, args.rounds, args.dir, args.out)
    import torch

    names = [n for n in args.only.split(",") if n]
    if unknown := set(names) - set(ALL):
        raise SystemExit(f"--only: unknown runner(s) {sorted(unknown)}; choose from {ALL}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        out = os.path.join(tmp, "results.jsonl")
        for _ in range(args.passes):
            for name in names:
                os.sync()  # the previous runner's dirty pages are not flushed during this one's save
                launch(name, args, tmp, out)
        rows = _median_rows(map(json.loads, open(out))) if os.path.exists(out) else {}
    print(f"\nmodel {args.model}, ZeRO-3 / FSDP2 over {args.nproc} ranks, median of {args.rounds} rounds x "
          f"{args.passes} alternating passes; "
          f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}")
    fmt = "{:<9} {:>8} {:>9} {:>8} {:>8} {:>11} {:>11}"
    print(fmt.format("runner", "save s", "finish s", "load s", "MiB", "save / z3", "load / z3"))
    z3 = rows.get("z3")
    for name, r in rows.items():
        ratio = lambda key: f"{r[key] / z3[key]:.2f}x" if z3 else "-"  # noqa: E731
        print(fmt.format(name, f"{r['save_s']:.2f}", f"{r['finish_s']:.2f}", f"{r['load_s']:.2f}",
                         f"{r['bytes'] / 2**20:.0f}", ratio("save_s"), ratio("load_s")))
    if z3 and "z3-async" in rows:
        stall = rows["z3-async"]["save_s"] / z3["save_s"]
        print(f"\n[{'met ' if stall < 0.1 else 'MISS'}] async stall < 10% of a synchronous save: {stall:.1%}")
    for peer in ("ds3", "fsdp2"):
        if z3 and peer in rows:
            for key in ("save_s", "load_s"):
                ok = z3[key] <= rows[peer][key]
                print(f"[{'met ' if ok else 'MISS'}] z3 {key[:4]} no slower than {peer}: "
                      f"{z3[key]:.2f} vs {rows[peer][key]:.2f} s")


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
