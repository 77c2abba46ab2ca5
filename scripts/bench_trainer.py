"""The Hugging Face Trainer on Zero3D against the Trainer's own DeepSpeed ZeRO-3, in one invocation.

    python scripts/bench_trainer.py [--model A|B|L] [--nproc 2] [--steps N] [--rounds R]

Both peers run the same ``transformers.Trainer`` loop on the same seeded Llama
(scripts/bench_runners.py's models) and data, with the same DeepSpeed JSON at ZeRO stage 3
(bench_runners.ds_config: AdamW, clipping 1.0, fp32): ``ds3`` is ``transformers.Trainer`` with
``TrainingArguments(deepspeed=config)`` (accelerate -> deepspeed.initialize), ``z3`` is
``parallel3d.hf.Trainer(zero3d_config=config)``. Each run is its own ``torchrun`` job (so its
peak memory is its own), runs are interleaved over ``--rounds``. Per rank: the step time from
the Trainer's ``on_step_begin`` to ``on_step_end`` (the slowest rank's, median over the timed
steps, pooled over rounds), and the peak memory during training (peak RSS on the CPU, from a
reset after the engine is built; ``torch.cuda.max_memory_allocated`` on CUDA), max over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

PEERS = {"ds3": "Trainer + DeepSpeed Z3", "z3": "Trainer + Zero3D Z3"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="A", help="a scripts/bench_runners.py model: A (13.7M), B (134M), L (254M)")
    ap.add_argument("--steps", type=int, help="timed steps per run (default: the model's)")
    ap.add_argument("--warmup", type=int, help="untimed steps before them (default: the model's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--runner", help=argparse.SUPPRESS)  # internal: one peer under torchrun
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _step_timer(times: list[float], cuda: bool):
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    from bench_runners import _reset_peak_rss

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.reset_ok = _reset_peak_rss()  # the engine is built: measure training from here
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args, state, control, **kwargs):
            dist.barrier()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    return StepTimer()


def run(name: str, model_name: str, steps: int, warmup: int, out_path: str) -> None:
    """One peer on every rank of this torchrun job; rank 0 appends its JSON line to ``out_path``."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from bench_runners import ADAMW, CLIP, _max_over_ranks, _status_kib, build_model, ds_config, import_deepspeed, \
        model_spec

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    spec, world = model_spec(model_name), dist.get_world_size()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, spec.llama["vocab_size"], ((warmup + steps) * spec.micro * world, spec.seq), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    config = ds_config(spec, 3)
    deepspeed = name == "ds3"
    if deepspeed:
        import_deepspeed()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix=f"bench_trainer_{name}_"), per_device_train_batch_size=spec.micro,
        gradient_accumulation_steps=1, max_steps=warmup + steps, learning_rate=ADAMW["lr"],
        adam_beta1=ADAMW["betas"][0], adam_beta2=ADAMW["betas"][1], adam_epsilon=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"], max_grad_norm=CLIP, optim="adamw_torch", lr_scheduler_type="constant",
        logging_steps=10**9, save_strategy="no", report_to=[], use_cpu=not cuda, disable_tqdm=True,
        train_sampling_strategy="sequential", deepspeed=config if deepspeed else None)
    times: list[float] = []
    model = build_model(spec)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    if deepspeed:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[_step_timer(times, cuda)])
    else:
        from parallel3d.hf import Trainer as Zero3DTrainer

        trainer = Zero3DTrainer(model=model, args=args, train_dataset=data, zero3d_config=config,
                                callbacks=[_step_timer(times, cuda)])
    del model
    trainer.train()
    wall = time.perf_counter() - t0
    timed = _max_over_ranks([times[warmup:]])[0]  # a step lasts as long as its slowest rank
    peak = torch.tensor([torch.cuda.max_memory_allocated() // 1024 if cuda else _status_kib("VmHWM")],
                        dtype=torch.int64, device="cuda" if cuda else "cpu")
    gathered = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(gathered, peak)
    if dist.get_rank() == 0:
        with open(out_path, "a") as f:
            f.write(json.dumps({"runner": name, "model": model_name, "world": world, "params": n_params,
                                "step_s": timed, "peak_kib": [int(p) for p in gathered], "wall_s": wall,
                                "memory": "cuda_allocated" if cuda else "rss", "loss": trainer.state.log_history[-1]
                                .get("train_loss")}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def drive(args) -> None:
    from bench_zero import launch

    tmp = tempfile.mkdtemp(prefix="bench_trainer_")
    out = os.path.join(tmp, "results.jsonl")
    print(f"model {args.model}, {args.nproc} ranks, {args.rounds} rounds, logs in {tmp}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for rnd in range(args.rounds):
        for name in list(PEERS) if rnd % 2 == 0 else list(PEERS)[::-1]:
            t = time.time()
            ok = launch(name, args, args.nproc, out, os.path.join(tmp, f"{name}.r{rnd}.log"), script=__file__)
            print(f"  round {rnd} {name:<4} {'ok' if ok else 'FAILED'} in {time.time() - t:.0f}s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    results = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    if not results:
        sys.exit("no run finished")
    stats = {}
    for name in PEERS:
        runs = [r for r in results if r["runner"] == name]
        if runs:
            stats[name] = {"median_s": statistics.median(t for r in runs for t in r["step_s"]),
                           "peak_mib": statistics.median(max(r["peak_kib"]) / 1024 for r in runs),
                           "loss": runs[0]["loss"], "memory": runs[0]["memory"], "params": runs[0]["params"]}
    print(f"\n{'peer':<24} {'step s (median)':>16} {'peak MiB/rank':>14} {'train loss':>11}")
    for name, s in stats.items():
        print(f"{PEERS[name]:<24} {s['median_s']:>16.4f} {s['peak_mib']:>14.0f} {s['loss']:>11.5f}")
    if len(stats) == 2:
        print(f"\nZero3D / DeepSpeed: step time x{stats['z3']['median_s'] / stats['ds3']['median_s']:.2f}, "
              f"peak memory ({stats['z3']['memory']}) x{stats['z3']['peak_mib'] / stats['ds3']['peak_mib']:.2f}")


def main() -> None:
    args = parse_args()
    if args.runner:
        from bench_runners import model_spec

        spec = model_spec(args.model)
        run(args.runner, args.model, args.steps or spec.steps, spec.warmup if args.warmup is None else args.warmup,
            args.out)
    else:
        drive(args)


if __name__ == "__main__":
    main()
