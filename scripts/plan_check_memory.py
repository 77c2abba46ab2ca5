"""The planner's peak memory per rank against CPU runs of the same layouts.

    python scripts/plan_check_memory.py [--only NAME,...] [--write-docs]

Each layout runs as its own ``torchrun --standalone`` job on CPU/gloo (fresh processes): a small
Llama is initialized and trained for two steps; the second step is measured. Per rank, two
measurements of the step's peak:

* **tensor bytes** (the criterion): every tensor storage the process creates from before
  ``initialize`` on, alive or freed, through a ``TorchDispatchMode`` (``planner.profile.LiveBytes``,
  which also follows ``UntypedStorage.resize_``, how ZeRO-3 frees and refills blocks); the peak of
  the bytes alive during the step. This is what ``torch.cuda.max_memory_allocated`` reports on a
  GPU, without the allocator's rounding and cache, and it is exact: no sampling.
* **RSS** (for the record): the growth of the resident set during the step (VmHWM after it,
  reset by ``/proc/self/clear_refs`` before it, minus VmRSS before it), with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns every freed block of 64 KiB or more to
  the system at once. RSS counts pages, not tensors: allocator slack, freed-but-kept small
  blocks and gloo's buffers add to it, pages of a fresh buffer count only once touched, so it
  is noisier and, where a step reuses what the first step left, lower.

The prediction is ``Planner.predict`` for the same model, workload and layout, per pipeline
stage; the measured value of a stage is the largest over its dp and tp ranks. With
``--write-docs`` the table replaces the one between the markers in docs/planner.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256)
SEQ, MICRO = 128, 2

# name: world, precision, zero stage, tp, pp, gas, and optionally: schedule, virtual stages, layers, zero keys,
# activation checkpointing, sequence parallelism, meta (build the model on the meta device)
LAYOUTS: dict[str, dict] = {
    "dp2 z1 bf16": dict(world=2, precision="bf16", stage=1, tp=1, pp=1, gas=2),
    "dp2 z3 fp32": dict(world=2, precision="fp32", stage=3, tp=1, pp=1, gas=2,
                        zero={"stage3_prefetch_bucket_size": 1_000_000, "stage3_param_persistence_threshold": 1000}),
    "tp2 dp2 z2 bf16": dict(world=4, precision="bf16", stage=2, tp=2, pp=1, gas=2),
    "tp2 dp2 z1 sp bf16": dict(world=4, precision="bf16", stage=1, tp=2, pp=1, gas=2, sequence_parallel=True),
    "pp2 dp2 z1 1f1b bf16": dict(world=4, precision="bf16", stage=1, tp=1, pp=2, gas=4, schedule="1f1b"),
    "pp2 dp2 z3 gpipe fp32": dict(world=4, precision="fp32", stage=3, tp=1, pp=2, gas=4, schedule="gpipe"),
    "pp2 tp2 z0 zb_h1 bf16": dict(world=4, precision="bf16", stage=0, tp=2, pp=2, gas=4, schedule="zb_h1"),
    "pp2 tp2 z0 zb_h1 bf16 meta": dict(world=4, precision="bf16", stage=0, tp=2, pp=2, gas=4, schedule="zb_h1",
                                       meta=True),
    "pp2 z2 interleaved fp32": dict(world=2, precision="fp32", stage=2, tp=1, pp=2, gas=4,
                                    schedule="interleaved_1f1b", virtual=2, layers=8),
    "pp2 tp2 z1 sp 1f1b bf16": dict(world=4, precision="bf16", stage=1, tp=2, pp=2, gas=4, schedule="1f1b",
                                    sequence_parallel=True),
    "pp2 dp2 z2 1f1b ac bf16": dict(world=4, precision="bf16", stage=2, tp=1, pp=2, gas=4, schedule="1f1b",
                                    checkpointing=True),
}


def _config(spec: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": spec["gas"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": spec["stage"], **spec.get("zero", {})},
        "bf16": {"enabled": spec["precision"] == "bf16"},
        "tensor_parallel": {"size": spec["tp"], "sequence_parallel": spec.get("sequence_parallel", False)},
        "steps_per_print": 1000,
    }
    if spec["pp"] > 1:
        config["pipeline"] = {"stages": spec["pp"], "schedule": spec["schedule"],
                              "virtual_stages": spec.get("virtual", 1),
                              "activation_checkpointing": spec.get("checkpointing", False)}
    return config


def _llama_config(spec: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**{**MODEL, "num_hidden_layers": spec.get("layers", MODEL["num_hidden_layers"])})


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def run_layout(name: str, out: str) -> None:
    """One torchrun job: initialize, one warm-up step, one measured step; rank 0 writes a JSON line."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import parallel3d
    from parallel3d.planner.profile import LiveBytes

    spec = LAYOUTS[name]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    live = LiveBytes()
    with live:
        with torch.device("meta") if spec.get("meta") else contextlib.nullcontext():
            model = LlamaForCausalLM(_llama_config(spec))
        engine, _, _, _ = parallel3d.initialize(model=model, config=_config(spec))
        del model
        dp_rank = engine.mesh.local_rank("dp")

        def batches():
            g = torch.Generator().manual_seed(dp_rank)
            ids = torch.randint(0, MODEL["vocab_size"], (spec["gas"], MICRO, SEQ), generator=g)
            return iter([{"input_ids": i, "labels": i} for i in ids])

        engine.train_batch(batches())
        live.reset_peak()
        before, rss_before = live.live, _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        engine.train_batch(batches())
        peak, hwm = live.peak, _status_kib("VmHWM")
    row = torch.tensor([engine.mesh.local_rank("pp"), peak, before, (hwm - rss_before) * 1024,
                        sum(engine.memory_report().values())], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        with open(out, "a") as f:
            f.write(json.dumps({"name": name, "ranks": [r.tolist() for r in rows]}) + "\n")
    dist.destroy_process_group()


def predict(name: str) -> list:
    """The planner's ``RankMemory`` of every pipeline stage of layout ``name``."""
    import torch
    from transformers import LlamaForCausalLM

    from parallel3d.planner.hardware import cpu
    from parallel3d.planner.predict import Layout, Planner, Workload

    spec = LAYOUTS[name]
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config(spec))
    zero = spec.get("zero", {})
    dp = spec["world"] // (spec["tp"] * spec["pp"])
    workload = Workload(seq=SEQ, global_batch=MICRO * spec["gas"] * dp,
                        dtype=torch.bfloat16 if spec["precision"] == "bf16" else torch.float32,
                        prefetch=zero.get("stage3_prefetch_bucket_size", 50_000_000),
                        persistence_threshold=zero.get("stage3_param_persistence_threshold", 100_000))
    layout = Layout(spec["pp"], dp, spec["tp"], spec["stage"], MICRO, spec.get("schedule", "1f1b"),
                    spec.get("virtual", 1), spec.get("checkpointing", False), spec.get("sequence_parallel", False))
    return Planner(model, workload).predict(layout, cpu(spec["world"])).ranks


def table(results: list[dict]) -> str:
    mib = 2**20
    lines = ["| layout | stage | predicted MiB (at) | measured tensor MiB | error | RSS growth in step MiB "
             "(predicted growth) | model states MiB |",
             "|---|---|---|---|---|---|---|"]
    worst = 0.0
    for r in results:
        for s, (pred, meas) in enumerate(zip(r["predicted"], r["measured"])):
            err = (pred["peak"] - meas["peak"]) / meas["peak"]
            worst = max(worst, abs(err))
            lines.append(f"| {r['name']} | {s} | {pred['peak'] / mib:.1f} ({pred['where']}) | {meas['peak'] / mib:.1f} | "
                         f"{100 * err:+.1f}% | {meas['rss'] / mib:.1f} ({(pred['peak'] - meas['before']) / mib:.1f}) | "
                         f"{meas['states'] / mib:.1f} |")
    lines.append("")
    lines.append(f"Largest error: {100 * worst:.1f}% over {sum(len(r['measured']) for r in results)} pipeline stages "
                 f"of {len(results)} layouts.")
    return "\n".join(lines)


def write_between_markers(doc: Path, marker: str, text: str) -> None:
    """Replace what lies between ``<!-- marker:begin -->`` and ``<!-- marker:end -->`` in ``doc``."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    head, rest = doc.read_text().split(begin)
    _, tail = rest.split(end)
    doc.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main() -> None:
    from bench_launch import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layout names")
    ap.add_argument("--write-docs", action="store_true", help="replace the table in docs/planner.md")
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--runner", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.runner:
        run_layout(args.runner, args.out)
        return
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    out = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    results = []
    for name in names:
        if not launch(__file__, name, LAYOUTS[name]["world"], ["--out", out], args.timeout, env):
            continue
        measured = [json.loads(line) for line in open(out) if json.loads(line)["name"] == name][-1]["ranks"]
        predicted = predict(name)
        stages = []
        for s in range(len(predicted)):
            mine = [r for r in measured if int(r[0]) == s]
            top = max(mine, key=lambda r: r[1])
            stages.append({"peak": top[1], "before": top[2], "rss": max(r[3] for r in mine), "states": top[4]})
        results.append({"name": name, "measured": stages,
                        "predicted": [{"peak": p.peak, "where": p.where} for p in predicted]})
        print(table(results[-1:]).splitlines()[2], flush=True)
    text = table(results)
    print("\n" + text)
    if args.write_docs:
        write_between_markers(ROOT / "docs" / "planner.md", "memory-check", text)
    os.unlink(out)


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
