"""Start-up cost: peak memory and wall time of building a model and ``initialize``, per rank.

    python scripts/bench_init.py [--model 254m|B|B-pad] [--nproc 4] [--only z3-meta,z3-eager,...]

Each runner is its own ``torchrun --standalone`` job (fresh processes, so a peak is its own):

| runner | what every rank does |
|---|---|
| z3-eager | ``torch.manual_seed(0)``, build the Llama on CPU, ``parallel3d.initialize`` (ZeRO-3, dp = nproc) |
| z3-meta | the same model built under ``torch.device("meta")``, then ``initialize`` (ZeRO-3) |
| pp2tp2-eager / pp2tp2-meta | the same, with pipeline.stages 2 x tensor_parallel.size 2 (ZeRO-1, dp = nproc / 4) |
| ds-zinit | DeepSpeed: build inside ``deepspeed.zero.Init`` (ZeRO-3), ``deepspeed.initialize`` |
| fsdp2-meta | FSDP2: meta build, ``fully_shard`` per decoder layer and root, ``to_empty``, HF ``_init_weights`` |
| z3-pretrained | meta build, ``initialize(..., pretrained=DIR)`` (ZeRO-3): each rank reads its slices |
| hf-pretrained | every rank ``from_pretrained(DIR)`` whole, then ``initialize`` (ZeRO-3): the old way |

DIR is written once by the driver (``save_pretrained``, safetensors). Reported per runner, the
maximum over ranks of: *added* = peak RSS (VmHWM) after start-up minus RSS before the build
(the process group, transformers' Llama code and the runner's own library, ``parallel3d``,
``deepspeed`` or ``torch.distributed.fsdp``, already imported; the peak is reset after
importing), *imports* = what those imports added to RSS, the wall time from build to the end of
``initialize``, and for Zero3D the model state it then holds (``memory_report()``) and its
largest unit. Targets (issue 8): for z3-meta and pp2tp2-meta, added <= state + 2 largest
units, and <= 0.5 x the full fp32 model at 4 ranks.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_launch import launch as launch_runner, runner_parser  # noqa: E402

MODELS = {
    "254m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2464, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=16),
    "B": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=12),
}
# B with a padding token: its embedding's padding_idx row is zeroed after the draw, so the
# init replay holds that tensor whole while it is made
MODELS["B-pad"] = dict(MODELS["B"], pad_token_id=0)
ALL = ["z3-eager", "z3-meta", "pp2tp2-eager", "pp2tp2-meta", "ds-zinit", "fsdp2-meta", "z3-pretrained", "hf-pretrained"]

def parse_args(argv=None):
    return runner_parser(__doc__, ALL, "254m", sorted(MODELS), 4).parse_args(argv)


def llama_config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS[name], max_position_embeddings=256)


def zero_config(stage: int, pp: int = 1, tp: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2 if pp > 1 else 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "tensor_parallel": {"size": tp},
            "pipeline": {"stages": pp}, "steps_per_print": 10**9}


# -- runners (inside torchrun) ---------------------------------------------------------------


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak() -> None:
    """Set VmHWM to the current RSS (Linux >= 4.0), so a peak while importing is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _import_runner(name: str) -> None:
    """Import what the runner uses, before the baseline: *added* is then the model's and the
    start-up's own memory, the same for every runner (the imports are reported apart)."""
    import importlib
    import logging

    import torch.distributed as dist
    from transformers import LlamaForCausalLM  # noqa: F401  (the modeling code is a lazy import)

    if name == "ds-zinit":
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.utils.logger.setLevel(logging.WARNING)
    elif name == "fsdp2-meta":
        importlib.import_module("torch.distributed.fsdp")
    else:
        importlib.import_module("parallel3d")


def _build(cfg, meta: bool):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


def _zero3d(cfg, meta: bool, stage: int = 3, pp: int = 1, tp: int = 1, pretrained: str | None = None):
    import parallel3d

    engine, _, _, _ = parallel3d.initialize(model=_build(cfg, meta), config=zero_config(stage, pp, tp), pretrained=pretrained)
    units = engine.optimizer.units
    return sum(engine.memory_report().values()), max(u.padded * 4 for u in units)


def _hf_pretrained(cfg, directory: str):
    import parallel3d
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory)
    engine, _, _, _ = parallel3d.initialize(model=model, config=zero_config(3))
    return sum(engine.memory_report().values()), max(u.padded * 4 for u in engine.optimizer.units)


def _deepspeed(cfg):
    import deepspeed
    from transformers import LlamaForCausalLM

    config = zero_config(3)
    for key in ("tensor_parallel", "pipeline"):
        config.pop(key)
    import torch

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(cfg)
    deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return None, None


def _fsdp2(cfg):
    import torch
    from torch.distributed.fsdp import fully_shard

    model = _build(cfg, meta=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.apply(model._init_weights)
    torch.optim.AdamW(model.parameters(), lr=1e-4)
    return None, None


def run_runner(name: str, model: str, directory: str | None, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = llama_config(model)
    dist.barrier()
    before_imports = _kib("VmRSS")
    _import_runner(name)
    dist.barrier()
    _reset_peak()
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    if name == "ds-zinit":
        state, unit = _deepspeed(cfg)
    elif name == "fsdp2-meta":
        state, unit = _fsdp2(cfg)
    elif name == "hf-pretrained":
        state, unit = _hf_pretrained(cfg, directory)
    else:
        layout = dict(stage=1, pp=2, tp=2) if name.startswith("pp2tp2") else {}
        state, unit = _zero3d(cfg, meta="eager" not in name, pretrained=directory if name == "z3-pretrained" else None,
                              **layout)
    wall = time.perf_counter() - t0
    dist.barrier()
    row = torch.tensor([(_kib("VmHWM") - base) / 1024, wall, (state or 0) / 2**20, (unit or 0) / 2**20,
                        (base - before_imports) / 1024], dtype=torch.float64)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(out, "a") as f:
            f.write(json.dumps({"runner": name, "added_mib": row[0].item(), "wall_s": row[1].item(),
                                "state_mib": row[2].item() or None, "unit_mib": row[3].item() or None,
                                "imports_mib": row[4].item()}) + "\n")
    dist.destroy_process_group()


# -- driver ------------------------------------------------------------------------------------


def launch(name: str, args, directory: str, out: str) -> None:
    launch_runner(__file__, name, args.nproc, ["--model", args.model, "--dir", directory, "--out", out], args.timeout)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.runner:
        return run_runner(args.runner, args.model, args.dir, args.out)
    import torch
    from transformers import LlamaForCausalLM

    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(ALL)
    if unknown:
        raise SystemExit(f"--only: unknown runner(s) {sorted(unknown)}; choose from {ALL}")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(args.model))
        n_params = sum(p.numel() for p in model.parameters())
        if {"z3-pretrained", "hf-pretrained"} & set(names):
            model.save_pretrained(tmp)
        del model
        out = os.path.join(tmp, "results.jsonl")
        for name in names:
            launch(name, args, tmp, out)
        rows = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    full_mib = n_params * 4 / 2**20
    print(f"\nmodel {args.model}: Llama {n_params / 1e6:.1f}M params, fp32 {full_mib:.0f} MiB; {args.nproc} ranks; "
          f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}")
    fmt = "{:<14} {:>10} {:>9} {:>8} {:>10} {:>9} {:>12}"
    print(fmt.format("runner", "added MiB", "x model", "wall s", "state MiB", "unit MiB", "imports MiB"))
    for r in rows:
        cell = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
        print(fmt.format(r["runner"], f"{r['added_mib']:.0f}", f"{r['added_mib'] / full_mib:.2f}", f"{r['wall_s']:.1f}",
                         cell(r["state_mib"]), cell(r["unit_mib"]), f"{r['imports_mib']:.0f}"))
    print("\ntargets (added memory per rank):")
    for r in rows:
        if r["runner"] in ("z3-meta", "pp2tp2-meta"):
            bound = r["state_mib"] + 2 * r["unit_mib"]
            print(f"  [{'met ' if r['added_mib'] <= bound else 'MISS'}] {r['runner']} <= state + 2 units: "
                  f"{r['added_mib']:.0f} vs {bound:.0f} MiB")
            half = 0.5 * full_mib
            print(f"  [{'met ' if r['added_mib'] <= half else 'MISS'}] {r['runner']} <= 0.5 x fp32 model: "
                  f"{r['added_mib']:.0f} vs {half:.0f} MiB")


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
