"""The planner's peak memory per rank against ``zero3d simulate`` of 1B-13B Llamas.

    python scripts/validate_memory_model.py [--only NAME,...] [--write-docs] [--predict-only]

Each layout's rank is simulated with ``zero3d simulate ... --json`` (one rank of the job alone
on torch's fake backend, a child process each, on this machine's CPU): the model built from the
meta device through ``initialize``, two optimizer steps of random tokens, the peak of tensor
bytes alive measured (what ``torch.cuda.max_memory_allocated`` counts, without the caching
allocator's rounding). The rank is the one the planner predicts fullest. Measurements are kept
in docs/memory_validation.json (``--only`` re-simulates those layouts, the others are kept);
the predictions are recomputed on every run, so a change to the memory model is re-checked
with ``--predict-only`` in seconds. ``--write-docs`` puts the table between the markers in
docs/planner.md.

The layouts keep each rank's share small (large tp x pp) and the sequence short, so that one
simulation takes minutes on 2 CPU cores; the categories they cover (ZeRO 1-3, tp, pp, the
schedules, activation checkpointing, bf16 and fp32) are those whose sizes scale with the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

RESULTS = ROOT / "docs" / "memory_validation.json"

# Llama 3.2 1B, Llama 2 7B and 13B (their published configs)
MODELS = {
    "1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "7B": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "13B": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, tie_word_embeddings=False),
}

# name: model, then the zero3d simulate arguments
LAYOUTS: dict[str, dict] = {
    "1B tp4 pp2 z1 1f1b": dict(model="1B", tp=4, pp=2, dp=8, stage=1, seq=512, mb=1),
    "1B tp4 z3 ac": dict(model="1B", tp=4, pp=1, dp=8, stage=3, seq=512, mb=2, checkpointing=True),
    "7B tp8 pp4 z1 1f1b": dict(model="7B", tp=8, pp=4, dp=4, stage=1, seq=256, mb=1),
    "7B tp8 pp4 z2 interleaved": dict(model="7B", tp=8, pp=4, dp=2, stage=2, seq=256, mb=1,
                                      schedule="interleaved_1f1b", virtual=2),
    "7B tp8 pp4 z0 zb_h1": dict(model="7B", tp=8, pp=4, dp=2, stage=0, seq=256, mb=1, schedule="zb_h1"),
    "13B tp8 pp8 z3 gpipe ac fp32": dict(model="13B", tp=8, pp=8, dp=2, stage=3, seq=256, mb=1, schedule="gpipe",
                                         checkpointing=True, precision="fp32"),
    "13B tp8 pp8 z1 1f1b sp": dict(model="13B", tp=8, pp=8, dp=4, stage=1, seq=256, mb=1, sequence_parallel=True),
}


def args_of(spec: dict, model_dir: Path) -> list[str]:
    """The ``zero3d simulate`` arguments of a layout (without --rank / --json)."""
    args = [str(model_dir), "--tp", spec["tp"], "--pp", spec["pp"], "--dp", spec["dp"], "--stage", spec["stage"],
            "--seq-len", spec["seq"], "--micro-batch", spec["mb"], "--precision", spec.get("precision", "bf16"),
            "--device", "cpu", "--schedule", spec.get("schedule", "1f1b"),
            "--virtual-stages", spec.get("virtual", 1)]
    args += ["--checkpointing"] if spec.get("checkpointing") else []
    args += ["--sequence-parallel"] if spec.get("sequence_parallel") else []
    return [str(a) for a in args]


def model_dirs(tmp: Path) -> dict[str, Path]:
    from transformers import LlamaConfig

    dirs = {}
    for name, fields in MODELS.items():
        dirs[name] = tmp / name
        LlamaConfig(**fields, max_position_embeddings=4096, torch_dtype="bfloat16").save_pretrained(dirs[name])
    return dirs


def prediction(spec: dict, model_dir: Path):
    """The planner's ``Prediction`` for the layout, as ``zero3d simulate`` computes it."""
    from parallel3d.planner.cli import load_model, quiet_transformers
    from parallel3d.simulate.cli import build_parser, layout_of, predict

    quiet_transformers()
    args = build_parser().parse_args(args_of(spec, model_dir))
    args.grad_accum = args.pp
    model = load_model(args.model)
    return predict(model, layout_of(args), args, args.precision, "cpu")


def simulate(spec: dict, model_dir: Path, rank: int, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "parallel3d.cli", "simulate", *args_of(spec, model_dir), "--rank", str(rank),
           "--json", "--timeout", str(timeout)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}\n{done.stdout[-2000:]}")
    return json.loads(done.stdout)[0]


def table(results: dict[str, dict], predicted: dict[str, dict]) -> str:
    mib = 2**20
    lines = ["| layout | params | rank (pp stage) | predicted peak MiB (at) | simulated peak MiB | error | model states MiB "
             "(predicted = measured) | rest at peak MiB: predicted / measured | RSS peak MiB | s per step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for name, r in results.items():
        p = predicted[name]
        err = (p["peak"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        worst = max(worst, abs(err))
        states = r["measured"]["model_states"]
        same = "=" if p["model_states"] == states else f"{p['model_states'] / mib:.0f} vs"
        steps = r["seconds"]["steps"]
        lines.append(
            f"| {name} | {MODELS[LAYOUTS[name]['model']]['num_hidden_layers']} layers, {r['model_params'] / 1e9:.2f}B | "
            f"{r['rank']} ({r['pp_rank']}) | {p['peak'] / mib:.0f} ({p['where']}) | {r['measured_peak_bytes'] / mib:.0f} | "
            f"{100 * err:+.1f}% | {same} {states / mib:.0f} | {(p['peak'] - p['model_states']) / mib:.0f} / "
            f"{(r['measured_peak_bytes'] - states) / mib:.0f} | {r['measured']['rss_peak_bytes'] / mib:.0f} | "
            f"{steps[-1]:.0f} |")
    lines += ["", f"Largest error: {100 * worst:.1f}% over {len(results)} layouts (the planner's peak against the "
                  "simulated rank's peak of tensor bytes; model states are `memory_report()`)."]
    return "\n".join(lines)


def main() -> None:
    from parallel3d.planner.cli import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated layout names to simulate again (default: those not in the results)")
    ap.add_argument("--predict-only", action="store_true", help="simulate nothing: predictions against stored results")
    ap.add_argument("--write-docs", action="store_true", help="replace the table in docs/planner.md")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per simulated rank")
    ap.add_argument("--jobs", type=int, default=3, help="ranks simulated at once (default 3)")
    args = ap.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    names = [n for n in args.only.split(",") if n] if args.only else [n for n in LAYOUTS if n not in results]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs(Path(tmp))
        params = {m: sum(p.numel() for p in load_model(str(d)).parameters()) for m, d in dirs.items()}
        predictions = {name: prediction(spec, dirs[spec["model"]]) for name, spec in LAYOUTS.items()}
        if not args.predict_only and names:
            with ThreadPoolExecutor(args.jobs) as pool:  # child processes: several share a loaded machine better
                running = {}
                for name in names:
                    spec, pred = LAYOUTS[name], predictions[name]
                    rank = max(range(len(pred.ranks)), key=lambda s: pred.ranks[s].peak) * spec["dp"] * spec["tp"]
                    print(f"simulating {name}, rank {rank} ...", flush=True)
                    running[pool.submit(simulate, spec, dirs[spec["model"]], rank, args.timeout)] = name
                for done in as_completed(running):
                    name = running[done]
                    results[name] = {**done.result(), "model_params": params[LAYOUTS[name]["model"]]}
                    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
                    print(f"done: {name}", flush=True)
    predicted = {}
    for name, r in results.items():
        if name in predictions:
            rank = predictions[name].ranks[r["pp_rank"]]
            predicted[name] = {"peak": rank.peak, "where": rank.where, "model_states": rank.model_states}
    order = [n for n in LAYOUTS if n in results]
    text = table({n: results[n] for n in order}, predicted)
    print(text)
    if args.write_docs:
        from plan_check_memory import write_between_markers

        write_between_markers(ROOT / "docs" / "planner.md", "simulate-check", text)


if __name__ == "__main__":
    main()
