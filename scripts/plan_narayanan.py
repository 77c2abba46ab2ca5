"""The planner's step time against Narayanan et al. 2021 (Megatron-LM at scale, SC21), Table 1.

    python scripts/plan_narayanan.py [--rows 1.7,39.1] [--search] [--write-docs]

For each row of their Table 1 (GPT models of 1.7B to 1T parameters, vocabulary 51,200, sequence
2048, their tensor-parallel size t, pipeline size p, data-parallel size d = n / (t p) and global
batch B on n A100s), the planner predicts the step time of their layout on A100 numbers
(``planner.hardware.a100``: 312 TFLOP/s bf16, 2.0 TB/s HBM, NVLink 300 GB/s per direction in a
node of 8, one 25 GB/s InfiniBand card per GPU across nodes) and turns it into TFLOP/s per GPU
with *their* FLOP count, 96 B s l h^2 (1 + s / 6h + V / 16 l h) (activation recomputation
included), so both columns count the same operations.

What is fixed a priori, for every row alike: their layout runs 1F1B (PipeDream-Flush) with
micro-batch 1, full activation recomputation and no ZeRO (Megatron had none); attention is
Megatron-LM's of the time, scores materialized with a fused scale-mask-softmax (the tensors
Korthikanti et al. 2022 count), not flash; the model is transformers' GPT-2 at their sizes
(``gelu_pytorch_tanh``, dropout 0.1), as Zero3D would run it; matrix products reach 75% of peak
and memory-bound kernels 80% of HBM bandwidth (``Hardware`` defaults, chosen before this
comparison, not fitted to it). Table 1 does not give micro-batch or schedule.

``--search`` also runs the planner's own search on each row's devices and batch (every t, p,
micro-batch, schedule, ZeRO stage, recomputation) and reports its pick next to their layout.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Table 1 of Narayanan et al. 2021: parameters (billions), attention heads, hidden size, layers,
# tensor-parallel size, pipeline-parallel size, GPUs, batch size, achieved TFLOP/s per GPU
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def their_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one step by their formula (Narayanan et al. 2021, eq. 3, with recomputation)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def planner_for(heads: int, hidden: int, layers: int, batch: int):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from parallel3d.planner.predict import Planner, Workload

    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=VOCAB, n_positions=SEQ,
                        activation_function="gelu_pytorch_tanh")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Planner(model, Workload(seq=SEQ, global_batch=batch, dtype=torch.bfloat16))


def run(rows: list[tuple], do_search: bool) -> list[dict]:
    from parallel3d.planner.hardware import a100
    from parallel3d.planner.predict import Layout
    from parallel3d.planner.search import Choice, search

    results = []
    for params, heads, hidden, layers, t, p, gpus, batch, reported in rows:
        start = time.perf_counter()
        planner = planner_for(heads, hidden, layers, batch)
        hw = replace(a100(gpus), attention="materialized")
        flops = their_flops(batch, layers, hidden)
        theirs = planner.predict(Layout(p, gpus // (t * p), t, 0, 1, "1f1b", 1, True, False), hw)
        tflops = flops / theirs.step_seconds / gpus / 1e12
        row = {"params": params, "t": t, "p": p, "d": gpus // (t * p), "gpus": gpus, "batch": batch,
               "reported": reported, "predicted": tflops, "error": (tflops - reported) / reported,
               "step": theirs.step_seconds, "parts": theirs.parts, "peak_gib": theirs.peak / 2**30}
        if do_search:
            found = search(planner, hw, Choice(max_micro_batch=8), top=3)
            best, considered = found.best, found.considered
            pick = best[0] if best else None
            row.update(considered=considered, pick=pick.layout.describe() if pick else "none fits",
                       pick_tflops=flops / pick.step_seconds / gpus / 1e12 if pick else 0.0,
                       pick_peak_gib=pick.peak / 2**30 if pick else 0.0, pick_parts=pick.parts if pick else {},
                       same=pick is not None and (pick.layout.tp, pick.layout.pp) == (t, p))
        row["seconds"] = time.perf_counter() - start
        results.append(row)
        print(f"{params}B: predicted {tflops:.1f} TFLOP/s vs reported {reported} ({100 * row['error']:+.1f}%)"
              + (f"; planner picks {row['pick']} at {row['pick_tflops']:.1f}" if do_search else "")
              + f" [{row['seconds']:.0f} s]", flush=True)
    return results


def table(results: list[dict]) -> str:
    search = "pick" in results[0]
    head = ("| params (B) | t | p | d | GPUs | batch | reported TFLOP/s | predicted | error | step s (pipeline / dp / "
            "optimizer) | peak GiB |")
    lines = [head + (" planner's pick (predicted TFLOP/s, peak GiB) |" if search else ""),
             "|" + "---|" * (11 + search)]
    for r in results:
        parts = r["parts"]
        line = (f"| {r['params']} | {r['t']} | {r['p']} | {r['d']} | {r['gpus']} | {r['batch']} | {r['reported']} | "
                f"{r['predicted']:.1f} | {100 * r['error']:+.1f}% | {r['step']:.2f} ({parts['pipeline']:.2f} / "
                f"{parts['data parallel']:.2f} / {parts['optimizer']:.2f}) | {r['peak_gib']:.1f} |")
        if search:
            line += f" {r['pick']} ({r['pick_tflops']:.1f}, {r['pick_peak_gib']:.1f}) |"
        lines.append(line)
    worst = max(abs(r["error"]) for r in results)
    lines += ["", f"Largest error: {100 * worst:.1f}% over {len(results)} rows; "
              f"{sum(abs(r['error']) <= 0.15 for r in results)} of {len(results)} within 15%."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help="comma-separated parameter counts of the rows to run (default: all)")
    ap.add_argument("--search", action="store_true", help="also run the planner's own search per row")
    ap.add_argument("--write-docs", action="store_true", help="replace the table in docs/planner.md")
    args = ap.parse_args()
    rows = TABLE1
    if args.rows:
        wanted = {float(x) for x in args.rows.split(",")}
        rows = [r for r in TABLE1 if r[0] in wanted]
        if not rows:
            ap.error(f"no row with parameters in {sorted(wanted)}; rows: {', '.join(str(r[0]) for r in TABLE1)}")
    text = table(run(rows, args.search))
    print("\n" + text)
    if args.write_docs:
        marker = "narayanan-search" if args.search else "narayanan"
        doc = ROOT / "docs" / "planner.md"
        head, rest = doc.read_text().split(f"<!-- {marker}:begin -->")
        _, tail = rest.split(f"<!-- {marker}:end -->")
        doc.write_text(f"{head}<!-- {marker}:begin -->\n{text}\n<!-- {marker}:end -->{tail}")


if __name__ == "__main__":
    main()
