"""The planner's best layouts for DeepSeek V3 with and without expert parallelism (issue 31).

DeepSeek V3's shape is transformers' ``DeepseekV3Config`` defaults (the released model: 61 layers,
the first 3 dense, 256 routed experts of which 8 per token plus one shared, hidden 7168, expert
intermediate 2048, MLA attention with 128 heads; 671B parameters), built on the meta device.
``--layers`` cuts it to fewer layers (the first 3 stay dense) where profiling the whole is too slow.

    python scripts/plan_moe.py --gpus 256 --seq-len 4096 --global-batch 1024
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from parallel3d.planner.cli import quiet_transformers, row
    from parallel3d.planner.hardware import h100
    from parallel3d.planner.predict import Planner, Workload
    from parallel3d.planner.search import Choice, search

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    quiet_transformers()
    config = DeepseekV3Config(num_hidden_layers=args.layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(t.numel() for t in model.parameters())
    hw = h100(args.gpus, 8)
    print(f"DeepSeek V3 shape, {args.layers} layers, {total / 1e9:.0f}B parameters; {hw.gpus} x {hw.name}, "
          f"seq {args.seq_len}, global batch {args.global_batch}, bf16\n")
    tokens = args.global_batch * args.seq_len
    planner = Planner(model, Workload(seq=args.seq_len, global_batch=args.global_batch))  # profiles shared
    for title, ep in (("without expert parallelism", 1), ("with expert parallelism (any E)", None)):
        start = time.perf_counter()
        result = search(planner, hw, Choice(ep=ep, hybrid_sharding=False, zeropp=False), top=args.top)
        print(f"{title}: {result.considered} layouts considered, {time.perf_counter() - start:.0f} s")
        if not result.best:
            print("  none fits: " + result.why_none())
        for prediction in result.best:
            r = row(prediction, hw, tokens)
            print(f"  {r['layout']:<40} peak {r['peak_gib']:6.1f} GiB  states {r['model_states_gib']:6.1f} GiB  "
                  f"step {r['step_s']:8.2f} s  {r['tokens_per_s']:9.0f} tokens/s")
        print()


if __name__ == "__main__":
    main()
