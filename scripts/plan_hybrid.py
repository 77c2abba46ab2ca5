"""The planner's predicted gain of hybrid sharding (one ZeRO shard group per node) and of ZeRO++
(int8 gathers and gradients, hpZ over a node) over flat ZeRO.

    python scripts/plan_hybrid.py [--gpus 1024] [--gpus-per-node 8] [--seq-len 4096] [--global-batch 2048]

A Llama 2 70B shape (hidden 8192, 80 layers, GQA 8 kv heads) built on the meta device, A100s
with their NVLink, and per-GPU network bandwidths of 100 and 400 Gb/s: for ZeRO-3 pinned at tp 1
and pp 1 (the setting of ZeRO++'s and MiCS's papers) and for the planner's free choice, the step
time of the best flat layout against the best hybrid one (``mics_shard_size`` one node's or a
few nodes' data-parallel ranks; a hybrid layout counts only where it is faster than its flat
twin), the best ZeRO++ one (stage 3 on a shard group spanning nodes, likewise only where faster
than its twin without it), and their ratios to the flat one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from parallel3d.planner.hardware import Link, a100  # noqa: E402
from parallel3d.planner.predict import Planner, Workload  # noqa: E402
from parallel3d.planner.search import Choice, search  # noqa: E402

LLAMA_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8)


def best(planner: Planner, hw, choice: Choice, hybrid: bool, zeropp: bool):
    result = search(planner, hw, dataclasses.replace(choice, hybrid_sharding=hybrid, zeropp=zeropp), top=40)
    fits = [p for p in result.best if bool(p.layout.shard) == hybrid and bool(p.layout.zeropp) == zeropp]
    return fits[0] if fits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=2048)
    args = ap.parse_args()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_70B))
    planner = Planner(model, Workload(seq=args.seq_len, global_batch=args.global_batch))
    print(f"Llama 70B shape, {args.gpus} x A100-80GB, {args.gpus_per_node} per node, seq {args.seq_len}, "
          f"global batch {args.global_batch}")
    print("network/GPU  layouts            best flat ZeRO              best hybrid sharding         speed-up"
          "  best ZeRO++                  speed-up")
    for gbps in (100, 400):
        hw = dataclasses.replace(a100(args.gpus, args.gpus_per_node), network=Link(gbps / 8 * 1e9, 10e-6))
        for label, choice in (("z3 tp1 pp1", Choice(tp=1, pp=1, zero_stage=3)), ("planner's choice", Choice())):
            flat = best(planner, hw, choice, False, False)
            row = f"{gbps:4d} Gb/s    {label:17s}  " + (_cell(flat) if flat else f"{'(none fits)':27s}")
            for other in (best(planner, hw, choice, True, False), best(planner, hw, choice, False, True)):
                row += "  " + (f"{_cell(other)}  {flat.step_seconds / other.step_seconds:5.2f}x" if flat and other
                               else f"{'(none faster than its twin)':35s}")
            print(row)


def _cell(prediction) -> str:
    return f"{prediction.step_seconds:6.2f} s {prediction.layout.describe():18s}"


if __name__ == "__main__":
    main()
