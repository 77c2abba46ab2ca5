"""Expert parallelism on CPU: a 16-expert MoE at ep 4 x dp 4 against ZeRO-3 without expert
parallelism and against DeepSpeed AutoEP on the same model (issue 31).

    python scripts/bench_ep.py [--nproc 4] [--steps 4] [--only z3,z3-ep,z1-ep,ds-autoep]

Each runner is its own ``torchrun --standalone`` job of ``--nproc`` ranks (fresh processes, so a
peak is its own). Every rank builds the same seeded Qwen3-MoE (16 routed experts of 4 layers,
top 2, router loss on), trains it in fp32 with AdamW on its own token batches, and reports:

| runner | what it is |
|---|---|
| z3 | Zero3D ZeRO-3 over the 4 data-parallel ranks: every expert of a layer gathered on every rank for its forward and backward, each rank computing its tokens' experts |
| z3-ep | ZeRO-3 with ``expert_parallel: {enabled: true, autoep_size: 4}``: each rank holds 4 experts of each layer, tokens cross by all-to-all; the dense weights ZeRO-3 sharded as before |
| z1-ep | the same at ZeRO-1: dense weights whole, experts 1/4 per rank |
| ds-autoep | DeepSpeed 0.19.8's AutoEP (``expert_parallel`` with ``autoep_size`` 4) at ZeRO-1, if it runs on this machine (else what stops it) |

Reported per runner, the maximum over ranks of: *step* = median seconds per step over the timed
steps, *peak* = peak RSS (VmHWM, reset after the warm-up step) over the steps, *experts* =
``memory_report(experts=True)`` (bytes of the experts' params, gradients and optimizer states on a
rank), *state* = all of ``memory_report()``. Ratios are against ``z3``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_launch import launch as launch_runner, runner_parser  # noqa: E402

RUNNERS = ["z3", "z3-ep", "z1-ep", "ds-autoep"]
EP = 4
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=2,
             output_router_logits=True, router_aux_loss_coef=0.01, max_position_embeddings=512)
MICRO, SEQ = 4, 256


def _config(stage: int, ep: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.1, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10_000}
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return config


def _model():
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL))


def _setup(name: str):
    """(step(ids), memory_report or None) of runner ``name`` on this rank."""
    import parallel3d
    from bench_runners import engine_step, import_deepspeed

    model = _model()
    if name == "ds-autoep":
        deepspeed = import_deepspeed()
        config = _config(1, EP)
        engine = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())[0]
        return engine_step(engine), None
    stage, ep = {"z3": (3, 1), "z3-ep": (3, EP), "z1-ep": (1, EP)}[name]
    config = _config(stage, ep)
    config["optimizer"]["params"].pop("torch_adam")
    engine = parallel3d.initialize(model=model, config=config)[0]
    return engine_step(engine), engine.memory_report


def run_runner(name: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from bench_runners import _max_over_ranks, _reset_peak_rss, _status_kib

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=g) for _ in range(steps + 1)]
    try:
        step, report = _setup(name)
    except Exception as exc:  # a peer that cannot run here: say what stops it, in the table
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps({"runner": name, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    step(batches[0])  # warm-up
    reset_ok = _reset_peak_rss()
    times = []
    for ids in batches[1:]:
        dist.barrier()
        t = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - t)
    times = _max_over_ranks([times])[0]
    states = report() if report else {}
    experts = sum(report(experts=True).values()) if report else -1
    mem = torch.tensor([_status_kib("VmHWM") if reset_ok else -1, sum(states.values()) if states else -1, experts],
                       dtype=torch.int64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "a") as f:
            f.write(json.dumps({"runner": name, "world": dist.get_world_size(), "median_s": statistics.median(times),
                                "peak_kib": int(mem[0]), "state_bytes": int(mem[1]), "expert_bytes": int(mem[2]),
                                "params": sum(p.numel() for p in _model().parameters())}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = runner_parser(__doc__, RUNNERS, "qwen3_moe", ["qwen3_moe"], 4)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if args.runner:
        run_runner(args.runner, args.steps, args.out)
        return
    out = os.path.join(tempfile.mkdtemp(prefix="bench_ep_"), "results.jsonl")
    for name in args.only.split(","):
        launch_runner(__file__, name, args.nproc, ["--steps", str(args.steps), "--out", out], args.timeout)
    rows = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    base = next((r for r in rows if r["runner"] == "z3"), None)
    sized = [r for r in rows if "params" in r]
    print(f"Qwen3-MoE, {sized[0]['params'] / 1e6:.1f}M params, 16 experts x 4 layers, {args.nproc} CPU ranks, "
          f"micro-batch {MICRO} x {SEQ}" if sized else "no runner finished")
    print("| runner | step s | vs z3 | peak MiB | vs z3 | model states MiB | experts MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['runner']} | does not run: {r['error'][:300]} |")
            continue
        ratio = (lambda k: f"{r[k] / base[k]:.2f}" if base and base[k] > 0 else "-")  # noqa: E731
        mib = (lambda v: f"{v / 2**20:.1f}" if v >= 0 else "-")  # noqa: E731
        print(f"| {r['runner']} | {r['median_s']:.3f} | {ratio('median_s')} | {r['peak_kib'] / 1024:.0f} | "
              f"{ratio('peak_kib')} | {mib(r['state_bytes'])} | {mib(r['expert_bytes'])} |")


if __name__ == "__main__":
    main()
