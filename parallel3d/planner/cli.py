"""``zero3d plan``: the layouts of a model that fit a cluster, ranked by predicted step time.

    zero3d plan MODEL --gpus 64 --gpu-memory 80GB --seq-len 2048 --global-batch 512
    zero3d plan MODEL --hostfile hosts --device a100 --seq-len 4096 --global-batch 1024 --zero-stage 1

MODEL is a Hugging Face model directory or its ``config.json`` (only the config is read; the
model is built on the meta device). Prints one row per layout: the mesh, ZeRO stage,
micro-batch, schedule, activation checkpointing and sequence parallelism; the predicted peak
memory of the fullest rank with its model states; the step time and where it goes; the
throughput. ``--png FILE`` draws every fitting layout's peak memory against its step time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from parallel3d.errors import ConfigError
from parallel3d.build.remote_code import check_remote_code

logger = logging.getLogger(__name__)

_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
PRECISIONS = ("bf16", "fp16", "fp32")


def parse_size(text: str, flag: str = "--gpu-memory") -> float:
    """Bytes in '80GB', '80 GiB', '81920MB' (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS or float(match[1]) <= 0:
        raise ConfigError(f"{flag} {text!r}: give a positive size with a unit, e.g. 80GB or 80GiB "
                          f"(units: {', '.join(u for u in _UNITS if u)})")
    return float(match[1]) * _UNITS[unit]


def build_parser() -> argparse.ArgumentParser:
    from parallel3d.pipeline.schedules import SCHEDULES
    from parallel3d.planner.hardware import PRESETS

    p = argparse.ArgumentParser(prog="zero3d plan", allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a Hugging Face model directory or config.json")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a model directory whose config.json has auto_map run its own Python code (default: refuse it)")
    where = p.add_argument_group("devices")
    where.add_argument("--gpus", type=int, help="number of devices")
    where.add_argument("--gpus-per-node", type=int, help="devices per node (default 8, or the hostfile's slots)")
    where.add_argument("--hostfile", help="DeepSpeed hostfile ('HOSTNAME slots=N' lines) instead of --gpus")
    where.add_argument("--gpu-memory", help="memory per device, e.g. 80GB (default: the --device's)")
    where.add_argument("--device", default="a100", choices=sorted(PRESETS),
                       help="peak FLOP/s, memory bandwidth and links (default a100)")
    where.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s that matrix products reach")
    work = p.add_argument_group("workload")
    work.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    work.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    work.add_argument("--precision", default="bf16", choices=PRECISIONS)
    pin = p.add_argument_group("pin a choice (default: the planner chooses)")
    pin.add_argument("--tp", type=int)
    pin.add_argument("--pp", type=int)
    pin.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    pin.add_argument("--micro-batch", type=int)
    pin.add_argument("--schedule", choices=SCHEDULES)
    pin.add_argument("--virtual-stages", type=int)
    pin.add_argument("--checkpointing", choices=("on", "off"))
    pin.add_argument("--sequence-parallel", choices=("on", "off"))
    pin.add_argument("--ep", type=int, metavar="E",
                     help="expert parallelism's size (expert_parallel.autoep_size; 1: off); default: the planner "
                          "tries 1 and, for a model with experts, the sizes its experts and ZeRO ranks allow")
    pin.add_argument("--etp", type=int, metavar="T",
                     help="expert_parallel.expert_tensor_parallel_size with --ep > 1 and tp > 1: 1 (each expert whole "
                          "on every tp rank) or the tp size (each expert split over them); default: both")
    pin.add_argument("--context-parallel", metavar="N|auto",
                     help="context parallelism (context_parallel.size): layouts with N ranks per sequence, or "
                          "\"auto\": every size dividing the ranks left over tp x pp (default: 1, off); each with "
                          "Ulysses and ring unless --cp-method pins one; prints the cp attention's bytes per layer")
    pin.add_argument("--cp-method", choices=("ulysses", "ring"), help="context_parallel.method (default: both)")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--png", help="draw peak memory against step time of every fitting layout")
    out.add_argument("--no-profile-cache", action="store_true",
                     help="profile every pass anew instead of reading and writing $ZERO3D_CACHE/plan-profiles")
    return p


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{flag} must be >= 1, got {value}")


def hardware_from_args(args: argparse.Namespace):
    """The cluster: a device preset, the device count (--gpus or a hostfile) and memory."""
    from parallel3d.launch.launcher import parse_hostfile
    from parallel3d.planner.hardware import PRESETS

    if (args.gpus is None) == (args.hostfile is None):
        raise ConfigError("give the devices as --gpus N or as --hostfile FILE (one of them)")
    per_node = args.gpus_per_node
    if args.hostfile is not None:
        hosts = parse_hostfile(args.hostfile)
        slots = {h.slots for h in hosts}
        if len(slots) != 1:
            raise ConfigError(f"hostfile {args.hostfile}: every host needs the same number of slots, got "
                              f"{sorted(slots)}")
        per_node, gpus = per_node or slots.pop(), sum(h.slots for h in hosts)
    else:
        gpus = args.gpus
    for value, flag in ((gpus, "--gpus"), (per_node, "--gpus-per-node"), (args.top, "--top")):
        _positive(value, flag)
    hw = PRESETS[args.device](gpus, min(per_node or 8, gpus))
    if args.gpu_memory is not None:
        hw = replace(hw, memory=parse_size(args.gpu_memory))
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise ConfigError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        hw = replace(hw, compute_efficiency=args.efficiency)
    return hw


def load_model(path: str, trust_remote_code: bool = False):
    """A meta-device model from a model directory or config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(path)
    if not source.exists():
        raise ConfigError(f"model {path!r}: no such file or directory (give a model directory or its config.json)")
    directory = source.parent if source.is_file() else source
    trust = check_remote_code(directory, trust_remote_code, "--trust-remote-code")
    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model {path!r}: cannot read a Hugging Face config there: {exc}") from None
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
        except ValueError as exc:
            raise ConfigError(f"model {path!r}: {type(config).__name__} is not a causal LM transformers knows: "
                              f"{exc}") from None
        except Exception as exc:  # noqa: BLE001 - the model's own constructor on this config: any error, reported
            raise ConfigError(f"model {path!r}: transformers cannot build {type(config).__name__}'s model from this "
                              f"config ({type(exc).__name__}: {exc})") from None


def _choice(args: argparse.Namespace):
    from parallel3d.planner.search import Choice

    for flag in ("tp", "pp", "micro_batch", "virtual_stages", "ep", "etp"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.etp == 1 and args.ep == 1:
        raise ConfigError("--etp 1 keeps each expert whole on every tp rank, the experts that expert parallelism "
                          "splits: it needs --ep > 1 (at --ep 1 tensor parallelism splits the experts, whatever --etp "
                          "says; unset: searched)")
    if args.etp is not None and args.etp > 1 and (args.ep == 1 or args.tp == 1):
        raise ConfigError(f"--etp {args.etp} splits the experts that expert parallelism cuts over the tp ranks: it "
                          f"needs --ep > 1 and --tp > 1 (given --ep {args.ep}, --tp {args.tp}; unset: searched)")
    if args.etp is not None and args.tp is not None and args.etp not in (1, args.tp):
        raise ConfigError(f"--etp {args.etp} with --tp {args.tp}: each expert is split over all the tp ranks or none; "
                          f"allowed: 1 or {args.tp}")
    onoff = {"on": True, "off": False, None: None}
    return Choice(tp=args.tp, pp=args.pp, zero_stage=args.zero_stage, micro_batch=args.micro_batch,
                  schedule=args.schedule, virtual_stages=args.virtual_stages,
                  checkpointing=onoff[args.checkpointing], sequence_parallel=onoff[args.sequence_parallel],
                  ep=args.ep, etp=args.etp, cp=_context_size(args.context_parallel), cp_method=args.cp_method)


def _context_size(value: str | None) -> int | None:
    """``--context-parallel``: None (not given) -> 1; "auto" -> None (searched); N -> N."""
    if value is None:
        return 1
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--context-parallel must be a positive integer or \"auto\", got {value!r}")
    return int(value)


def row(prediction, hw, tokens: int) -> dict:
    """One ranked layout as plain values."""
    fullest = max(prediction.ranks, key=lambda r: r.peak)
    return {
        "layout": prediction.layout.describe(),
        "peak_gib": fullest.peak / 2**30,
        "model_states_gib": fullest.model_states / 2**30,
        "activations_gib": fullest.activations / 2**30,
        "step_s": prediction.step_seconds,
        "parts_s": prediction.parts,
        "tokens_per_s": tokens / prediction.step_seconds,
        "tflops_per_device": prediction.flops_per_step / prediction.step_seconds / hw.gpus / 1e12,
    }


def format_table(rows: list[dict], hw, considered: int) -> str:
    head = (f"{'#':>3}  {'layout':<44} {'peak GiB':>8} {'states':>7} {'step s':>8} {'fwd+bwd s':>9} "
            f"{'dp comm':>8} {'tokens/s':>10} {'TFLOP/s':>8}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3}  {r['layout']:<44} {r['peak_gib']:>8.1f} {r['model_states_gib']:>7.1f} "
                     f"{r['step_s']:>8.3f} {r['parts_s']['pipeline']:>9.3f} {r['parts_s']['data parallel']:>8.3f} "
                     f"{r['tokens_per_s']:>10.0f} {r['tflops_per_device']:>8.1f}")
    lines.append(f"{len(rows)} shown of the layouts that fit {hw.gpus} x {hw.name} ({hw.memory / 1e9:.0f} GB); "
                 f"{considered} considered. TFLOP/s: counted FLOPs per device (recomputation included).")
    return "\n".join(lines)


def draw(predictions, hw, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install 'zero3d[plot]' (or matplotlib)") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for p in predictions:
        ax.scatter(p.step_seconds, p.peak / 2**30, s=14, color="C0" if p.layout.pp == 1 else "C1")
    for p in predictions[:5]:
        ax.annotate(p.layout.describe(), (p.step_seconds, p.peak / 2**30), fontsize=7)
    ax.axhline(hw.memory / 2**30, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("predicted peak memory of the fullest rank (GiB)")
    ax.set_title(f"layouts on {hw.gpus} x {hw.name} (blue: no pipeline, orange: pipeline)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def quiet_transformers() -> None:
    """Keep transformers' warnings (deprecations, use_cache notes on the profiled model) out of the output."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")
    # raised by transformers about its own argument, but attributed to torch's Module.__call__ frame
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`past_key_values` is deprecated")


def _context_lines(args: argparse.Namespace, model, layout, hw) -> str:
    from parallel3d.planner.context import context_table

    cp = layout.cp
    element_bytes = 4 if args.precision == "fp32" else 2
    return context_table(model.config.get_text_config(), cp, args.seq_len, layout.micro_batch, layout.tp,
                         element_bytes, hw.link(layout.tp, cp))


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from parallel3d.planner.predict import Planner, Workload
    from parallel3d.planner.profile_store import ProfileStore
    from parallel3d.planner.search import search
    from parallel3d.planner.report import LEGEND, header, layout_config, snippet

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    quiet_transformers()  # its deprecation and use_cache notices are about the profile's model, not the plan
    try:
        for value, flag in ((args.seq_len, "--seq-len"), (args.global_batch, "--global-batch")):
            _positive(value, flag)
        hw = hardware_from_args(args)
        choice = _choice(args)
        model = load_model(args.model, args.trust_remote_code)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
        store = None if args.no_profile_cache else ProfileStore.default(model.config, args.seq_len, dtype)
        planner = Planner(model, Workload(seq=args.seq_len, global_batch=args.global_batch, dtype=dtype),
                          store=store, workers=os.cpu_count() or 1)
        result = search(planner, hw, choice, top=max(args.top, 50 if args.png else args.top))
    except ConfigError as exc:
        print(f"zero3d plan: error: {exc}", file=sys.stderr)
        return 2
    best, considered = result.best, result.considered
    if not best:
        print(f"zero3d plan: none of the {considered} layouts considered fits {hw.gpus} x {hw.memory / 1e9:.0f} GB"
              + (": more devices, a shorter sequence, a smaller global batch, or ZeRO stage 3 / checkpointing if "
                 "pinned off" if considered > sum(result.unpriced.values()) else "")
              + (f"; {result.why_none()}" if result.refused or result.unpriced else ""), file=sys.stderr)
        return 1
    tokens = args.global_batch * args.seq_len
    rows = [row(p, hw, tokens) for p in best[: args.top]]
    for r, p in zip(rows, best):
        r["config"] = layout_config(p.layout, args.global_batch, args.precision)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("\n\n".join([header(hw, args.precision, args.seq_len, args.global_batch),
                            format_table(rows, hw, considered), LEGEND,
                            snippet(best[0].layout, args.global_batch, args.precision)]))
        if best[0].layout.cp > 1:
            print("\n" + _context_lines(args, model, best[0].layout, hw))
    if args.png:
        draw(best, hw, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":  # python -m parallel3d.planner.cli ARGS runs as zero3d does
    sys.exit(main())
