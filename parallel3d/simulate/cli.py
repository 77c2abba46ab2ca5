"""``zero3d simulate``: measure one rank of a large job on this machine, beside the planner's prediction.

    zero3d simulate MODEL_DIR --tp 8 --pp 4 --dp 16 --seq-len 2048 --micro-batch 1 --stage 1
    zero3d simulate MODEL_DIR --tp 8 --pp 8 --dp 16 --seq-len 4096 --micro-batch 1 --stage 3 --rank 0 --json

Each rank asked for (``--rank``, repeatable; default: the first and the last pipeline stage and
the stage the planner predicts fullest, at dp rank 0 and tp rank 0) runs alone in a child
process on torch's fake backend (parallel3d/simulate/rank.py): its real share of the model built
from the meta device through ``initialize``, ``--steps`` optimizer steps of ``--grad-accum``
micro-batches of random tokens. Printed per rank: the planner's prediction per category beside
what was measured (``memory_report()`` for the model states, the peak of the step, the resident
set on CPU). What a simulated rank cannot show is printed with it (:data:`NOT_SEEN`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from parallel3d.errors import ConfigError
from parallel3d.simulate.rank import RankSpec

PRECISIONS = ("bf16", "fp16", "fp32")
_CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

NOT_SEEN = (
    "the communication backend's own memory (NCCL's communicators, channels and staging buffers, "
    "typically 0.5-2 GiB per GPU; gloo's buffers): the fake backend allocates none",
    "the CUDA context and kernels (about 0.5 GiB per process, outside the allocator's counts)",
    "the values other ranks would send: receives are zero-filled, so losses and gradients are not "
    "those of the job (their sizes are)",
)
NOT_SEEN_CPU = ("the allocator's rounding, caching and fragmentation of a GPU (the tensor peak is what "
                "torch.cuda.max_memory_allocated would count without them)",)


def build_parser() -> argparse.ArgumentParser:
    from parallel3d.launch.launcher import whole_number
    from parallel3d.pipeline.schedules import SCHEDULES

    p = argparse.ArgumentParser(prog="zero3d simulate", allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a Hugging Face model directory or its config.json (only the config is read)")
    layout = p.add_argument_group("layout")
    layout.add_argument("--tp", type=whole_number(1), required=True, help="tensor-parallel size")
    layout.add_argument("--pp", type=whole_number(1), required=True, help="pipeline stages")
    layout.add_argument("--dp", type=whole_number(1), required=True, help="data-parallel size")
    layout.add_argument("--stage", type=int, choices=(0, 1, 2, 3), required=True, help="ZeRO stage")
    layout.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    layout.add_argument("--virtual-stages", type=whole_number(1), default=1,
                        help="model chunks per pipeline rank (interleaved schedules)")
    layout.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    layout.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (tp > 1)")
    work = p.add_argument_group("workload")
    work.add_argument("--seq-len", type=whole_number(1), required=True, help="tokens per sample")
    work.add_argument("--micro-batch", type=whole_number(1), required=True, help="samples per micro-batch")
    work.add_argument("--grad-accum", type=whole_number(1),
                      help="micro-batches per optimizer step (default: pp, the fewest that fill the pipeline)")
    work.add_argument("--precision", choices=PRECISIONS,
                      help="default: the model config's torch_dtype (bfloat16 -> bf16, float16 -> fp16, else fp32)")
    run = p.add_argument_group("run")
    run.add_argument("--rank", type=int, action="append",
                     help="global rank to simulate (repeat for several; default: the first, the last and the "
                          "predicted fullest pipeline stage)")
    run.add_argument("--steps", type=whole_number(1), default=2, help="optimizer steps (default 2)")
    run.add_argument("--device", choices=("cpu", "cuda"),
                     help="where the rank runs (default: cuda when there is one)")
    run.add_argument("--trust-remote-code", action="store_true",
                     help="let a model directory whose config.json has auto_map run its own Python code")
    run.add_argument("--timeout", type=whole_number(1), default=3600, help="seconds per rank (default 3600)")
    run.add_argument("--json", action="store_true", help="print a JSON list, one object per rank")
    return p


def layout_of(args: argparse.Namespace):
    """The planner's ``Layout`` of the arguments."""
    from parallel3d.planner.predict import Layout

    return Layout(args.pp, args.dp, args.tp, args.stage, args.micro_batch, args.schedule, args.virtual_stages,
                  args.checkpointing, args.sequence_parallel)


def engine_config(layout, grad_accum: int, precision: str) -> dict:
    """The engine config of the layout (the planner's snippet), AdamW, and for fp16 a static loss scale of 1,
    so that no simulated step is skipped by the dynamic scale's first overflows (a skipped step
    allocates no optimizer state)."""
    from parallel3d.planner.report import layout_config

    config = layout_config(layout, layout.dp * layout.micro_batch * grad_accum, precision)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5}}
    config["steps_per_print"] = 10**9
    if precision == "fp16":
        config["fp16"]["loss_scale"] = 1.0
    return config


def check(args: argparse.Namespace, model) -> None:
    """ConfigError for arguments that cannot describe a job of this model (one message each)."""
    if args.sequence_parallel and args.tp == 1:
        raise ConfigError("--sequence-parallel needs --tp > 1")
    world = args.tp * args.pp * args.dp
    for rank in args.rank or []:
        if not 0 <= rank < world:
            raise ConfigError(f"--rank {rank} is out of range: tp {args.tp} x pp {args.pp} x dp {args.dp} is {world} "
                              f"ranks, 0 to {world - 1}")
    layers = getattr(model.config, "num_hidden_layers", None)
    chunks = args.pp * args.virtual_stages
    if layers is not None and chunks > layers:
        raise ConfigError(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} = {chunks} pipeline chunks, but "
                          f"the model has {layers} layers (at least one each)")
    heads = getattr(model.config, "num_attention_heads", None)
    if heads is not None and heads % args.tp:
        raise ConfigError(f"--tp {args.tp} does not divide the model's {heads} attention heads")


def precision_of(args: argparse.Namespace, model) -> str:
    if args.precision is not None:
        return args.precision
    dtype = getattr(model.config, "torch_dtype", None) or getattr(model.config, "dtype", None)
    return _CONFIG_DTYPES.get(str(dtype).removeprefix("torch."), "fp32")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def predict(model, layout, args: argparse.Namespace, precision: str, device: str):
    """The planner's ``Prediction`` of the layout: every pipeline rank (tp rank 0, dp rank 0)."""
    import torch

    from parallel3d.planner.hardware import cpu, h100
    from parallel3d.planner.predict import Planner, Workload

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    planner = Planner(model, Workload(seq=args.seq_len, global_batch=layout.dp * layout.micro_batch * args.grad_accum,
                                      dtype=dtype))
    hw = (h100 if device == "cuda" else cpu)(layout.world)
    return planner.predict(layout, hw, exact=True)


def default_ranks(prediction) -> list[int]:
    """Global ranks of the first and last pipeline stage and of the fullest predicted one (dp 0, tp 0)."""
    layout = prediction.layout
    stages = {0, layout.pp - 1, max(range(layout.pp), key=lambda s: prediction.ranks[s].peak)}
    return [s * layout.dp * layout.tp for s in sorted(stages)]


def run_rank(spec: RankSpec, timeout: int) -> dict:
    """Simulate one rank in a child process; its result, or an ``error`` entry."""
    with tempfile.TemporaryDirectory(prefix="zero3d-simulate-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(asdict(spec)))
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed blocks go back: RSS follows the tensors
        try:
            done = subprocess.run([sys.executable, "-m", "parallel3d.simulate.rank", str(spec_path), str(out_path)],
                                  env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"rank": spec.rank, "error": f"did not finish within --timeout {timeout} s"}
        if not out_path.exists():
            tail = "\n".join((done.stderr or "").strip().splitlines()[-5:])
            return {"rank": spec.rank, "error": f"the simulation process ended with code {done.returncode}:\n{tail}"}
        return json.loads(out_path.read_text())


def combine(measured: dict, prediction, device: str) -> dict:
    """One rank's JSON object: measured and predicted, per category."""
    from zero.sizing import device_bytes

    if "error" in measured:
        return measured
    predicted = prediction.ranks[measured["pp_rank"]]
    report = measured["memory_report"]
    states_measured = device_bytes(report)
    rest_predicted = predicted.peak - predicted.model_states
    peak = measured["measured_peak_bytes"]
    return {
        **{k: measured[k] for k in ("rank", "world", "pp_rank", "dp_rank", "tp_rank", "device")},
        "measured_peak_bytes": peak,
        "predicted_peak_bytes": int(predicted.peak),
        "prediction_error": (predicted.peak - peak) / peak,
        "predicted": {**{k: int(v) for k, v in predicted.states.items()}, "model_states": int(predicted.model_states),
                      "gathered": int(predicted.gathered), "activations": int(predicted.activations),
                      "buffers": int(predicted.buffers), "step_extra": int(predicted.step_extra),
                      "rest_at_peak": int(rest_predicted), "peak_at": predicted.where},
        "measured": {**report, "model_states": int(states_measured), "rest_at_peak": int(peak - states_measured),
                     **{k: measured[k] for k in ("tensor_peak_bytes", "rss_peak_bytes", "rss_start_bytes",
                                                 "cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes")
                        if k in measured}},
        "seconds": {"init": measured["init_seconds"], "steps": measured["step_seconds"]},
        "not_seen": list(NOT_SEEN + (NOT_SEEN_CPU if device == "cpu" else ())),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:10.1f}"


def format_rank(row: dict) -> str:
    if "error" in row:
        return f"rank {row['rank']}: failed: {row['error']}"
    p, m = row["predicted"], row["measured"]
    lines = [f"rank {row['rank']} of {row['world']} (pp {row['pp_rank']}, dp {row['dp_rank']}, tp {row['tp_rank']}) "
             f"on {row['device']}", f"  {'MiB':<44}{'predicted':>10} {'measured':>10}"]
    for key in [k for k in p if k in m and k not in ("model_states", "rest_at_peak") and (p[k] or m[k])]:
        lines.append(f"  {key:<44}{_mib(p[key])} {_mib(m[key])}")
    lines.append(f"  {'model states':<44}{_mib(p['model_states'])} {_mib(m['model_states'])}")
    lines.append(f"  {'the rest at the peak':<44}{_mib(p['rest_at_peak'])} {_mib(m['rest_at_peak'])}")
    lines.append(f"    predicted: activations {p['activations'] / 2**20:.1f}, buffers {p['buffers'] / 2**20:.1f}, "
                 f"gathered {p['gathered'] / 2**20:.1f}, optimizer step {p['step_extra'] / 2**20:.1f} "
                 f"(at {p['peak_at']})")
    what = "CUDA allocator peak" if "cuda_peak_allocated_bytes" in m else "peak of tensor bytes"
    lines.append(f"  {'peak (' + what + ')':<44}{_mib(row['predicted_peak_bytes'])} {_mib(row['measured_peak_bytes'])}"
                 f"   prediction {100 * row['prediction_error']:+.1f}%")
    if "cuda_peak_reserved_bytes" in m:
        lines.append(f"  {'CUDA allocator reserved':<44}{'':>10} {_mib(m['cuda_peak_reserved_bytes'])}")
    lines.append(f"  {'process resident set (VmHWM)':<44}{'':>10} {_mib(m['rss_peak_bytes'])}")
    steps = ", ".join(f"{s:.1f}" for s in row["seconds"]["steps"])
    lines.append(f"  initialize {row['seconds']['init']:.1f} s, steps {steps} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from parallel3d.planner.cli import load_model, quiet_transformers

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    quiet_transformers()
    try:
        model = load_model(args.model, args.trust_remote_code)
        check(args, model)
        args.grad_accum = args.grad_accum or args.pp
        precision = precision_of(args, model)
        device = args.device or default_device()
        layout = layout_of(args)
        prediction = predict(model, layout, args, precision, device)
    except ConfigError as exc:
        print(f"zero3d simulate: error: {exc}", file=sys.stderr)
        return 2
    ranks = args.rank or default_ranks(prediction)
    config = engine_config(layout, args.grad_accum, precision)
    rows = []
    for rank in ranks:
        spec = RankSpec(model=str(Path(args.model).resolve()), rank=rank, world=layout.world, seq_len=args.seq_len,
                        micro_batch=args.micro_batch, grad_accum=args.grad_accum, config=config,
                        checkpointing_without_pipeline=args.checkpointing and args.pp == 1, steps=args.steps,
                        device=device, trust_remote_code=args.trust_remote_code)
        rows.append(combine(run_rank(spec, args.timeout), prediction, device))
        if not args.json:
            print(format_rank(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        not_seen = NOT_SEEN + (NOT_SEEN_CPU if device == "cpu" else ())
        print(f"layout {layout.describe()}, {precision}, seq {args.seq_len}, {args.grad_accum} micro-batches per step, "
              f"{args.steps} steps. Not seen by a simulated rank:\n" + "\n".join(f"  - {n}" for n in not_seen))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":  # python -m parallel3d.simulate.cli ARGS runs as zero3d does
    sys.exit(main())
