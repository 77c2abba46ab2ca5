""""auto" in a config: ``initialize`` asks the planner for the values it may choose.

Five keys accept ``"auto"``: ``tensor_parallel.size``, ``pipeline.stages``,
``zero_optimization.stage``, ``train_micro_batch_size_per_gpu`` and ``context_parallel.size``
(with it the planner also picks ``context_parallel.method`` unless the config gives one; a
given size is priced as it is, with its method). The planner needs what a
config does not otherwise say, in a ``planner`` section that only this step reads:

    "planner": {"seq_length": 2048, "device_memory": "80GB", "device": "a100"}

``seq_length`` is required; ``device_memory`` defaults to the device's own (CUDA: its total
memory; CPU: the machine's memory shared by the local processes), ``device`` (the rates of
``planner.hardware.PRESETS``) to the GPU's name (A100 or H100; CPU: ``cpu``). With an ``"auto"``
micro-batch ``train_batch_size`` must be given and ``gradient_accumulation_steps`` left out (it
follows). Every other key of the config pins its value (a given ``pipeline.schedule`` too); the
planner takes the fastest layout that fits and that the engine can run (activation
checkpointing comes from ``pipeline.activation_checkpointing``, so only with pipeline stages).
Every rank computes the same choice from the same inputs: no communication.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

AUTO_KEYS = (("tensor_parallel", "size"), ("pipeline", "stages"), ("zero_optimization", "stage"),
             (None, "train_micro_batch_size_per_gpu"), ("context_parallel", "size"))
PLANNER_KEYS = ("seq_length", "device_memory", "device")


def _get(raw: dict, section: str | None, key: str) -> Any:
    holder = raw if section is None else raw.get(section)
    return holder.get(key) if isinstance(holder, dict) else None


def _set(raw: dict, section: str | None, key: str, value: Any) -> None:
    (raw if section is None else raw.setdefault(section, {}))[key] = value


def _dotted(section: str | None, key: str) -> str:
    return key if section is None else f"{section}.{key}"


def _mapping(source: Any) -> dict | None:
    """The config as a mapping, or None when it cannot hold "auto" (already a Zero3DConfig)."""
    from parallel3d.config.config import Zero3DConfig, read_config_file

    if isinstance(source, Zero3DConfig):
        return None
    if isinstance(source, (str, Path)):
        return read_config_file(source)
    if isinstance(source, dict):
        return copy.deepcopy(source)
    return None


def _hardware(hints: dict, world: int, device: torch.device):
    from parallel3d.planner.cli import parse_size
    from parallel3d.planner.hardware import PRESETS, cpu

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    name = hints.get("device")
    if name is not None and name not in PRESETS:
        raise ConfigError(f"planner.device: {name!r} is not allowed; must be one of {', '.join(sorted(PRESETS))}")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device)
        name = name or ("h100" if "H100" in gpu.name else "a100")
        memory = gpu.total_memory
        hw = PRESETS[name](world, min(local, world))
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local)
        hw = PRESETS[name](world, min(local, world)) if name else cpu(world)
    if hints.get("device_memory") is not None:
        memory = parse_size(hints["device_memory"], "planner.device_memory")
    return replace(hw, memory=float(memory))


def _workload(cfg, seq: int):
    from parallel3d.planner.predict import Workload
    from zero.sizing import OptimizerStateShape

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.precision]
    optimizer = OptimizerStateShape(2, 1)
    if cfg.optimizer is not None:
        optimizer = OptimizerStateShape.of(cfg.optimizer.torch_optimizer_class_name(), cfg.optimizer.params)
    z = cfg.zero_optimization
    return Workload(seq=seq, global_batch=cfg.train_batch_size, dtype=dtype, optimizer=optimizer,
                    bucket_size=z.reduce_bucket_size, persistence_threshold=z.stage3_param_persistence_threshold,
                    prefetch=z.stage3_prefetch_bucket_size, max_live=z.stage3_max_live_parameters,
                    overlap_comm=z.overlap_comm, balance=cfg.pipeline.balance,
                    offload_optimizer=z.offloads_optimizer, offload_params=z.offloads_params,
                    quantized_weights=z.zero_quantized_weights, quantized_gradients=z.zero_quantized_gradients,
                    hpz=z.zero_hpz_partition_size, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0))


def _refuse_unpriced(cfg, model: nn.Module, autos: list) -> None:
    """The planner prices flat ZeRO over every data-parallel rank and every parameter trained: a
    choice for anything else would be priced wrong, so it is refused."""
    z = cfg.zero_optimization
    unpriced = [text for text, present in (
        (f"zero_optimization.mics_shard_size {z.mics_shard_size}", z.mics_shard_size != -1),
        ("frozen parameters (requires_grad=False, e.g. a PEFT model's base)",
         any(not p.requires_grad for p in model.parameters())),
    ) if present]
    if unpriced:
        raise ConfigError(f"{', '.join(_dotted(s, k) for s, k in autos)} = \"auto\" cannot be combined with "
                          f"{', '.join(unpriced)}: the planner prices flat ZeRO with every parameter trained, so its "
                          "choice would be priced wrong; give those values yourself (zero3d plan shows the flat "
                          "ranking)")


def resolve_auto(source: Any, model: nn.Module, world: int, device: torch.device) -> Any:
    """``source`` with every "auto" replaced by the planner's choice (unchanged without "auto").

    The planner's modules are imported only when a value is "auto": importing them costs a
    rank about 2 MiB of RSS (scripts/bench_init.py measured it in ``initialize``).
    """
    raw = _mapping(source)
    if raw is None:
        return source
    hints = raw.pop("planner", None)
    autos = [(s, k) for s, k in AUTO_KEYS if _get(raw, s, k) == "auto"]
    if not autos:
        if hints is not None:
            raise ConfigError("the config has a 'planner' section but no \"auto\" value; it is read only to "
                              f"choose {', '.join(_dotted(s, k) for s, k in AUTO_KEYS)} when one is \"auto\"")
        return source
    if not isinstance(hints, dict) or not isinstance(hints.get("seq_length"), int) or hints["seq_length"] < 1:
        raise ConfigError(f"{', '.join(_dotted(s, k) for s, k in autos)} = \"auto\" needs the sequence length: add "
                          "\"planner\": {\"seq_length\": N} (and optionally device_memory, e.g. \"80GB\", and device)")
    unknown = sorted(set(hints) - set(PLANNER_KEYS))
    if unknown:
        raise ConfigError(f"unknown config key 'planner.{unknown[0]}'; keys of planner: {', '.join(PLANNER_KEYS)}")
    micro_auto = (None, "train_micro_batch_size_per_gpu") in autos
    if micro_auto and (raw.get("train_batch_size") is None or raw.get("gradient_accumulation_steps") is not None):
        raise ConfigError("train_micro_batch_size_per_gpu = \"auto\" needs train_batch_size and no "
                          "gradient_accumulation_steps (the planner derives it from the micro-batch it picks)")
    probe = copy.deepcopy(raw)
    for s, k in autos:
        _set(probe, s, k, 1)
    if micro_auto:
        probe.pop("train_micro_batch_size_per_gpu")
    from parallel3d.config.config import Zero3DConfig
    from parallel3d.planner.predict import Planner
    from parallel3d.planner.search import Choice

    cfg = Zero3DConfig.from_dict(probe)  # every other key checked before planning
    _refuse_unpriced(cfg, model, autos)
    if cfg.train_batch_size is None:
        raise ConfigError("\"auto\" needs train_batch_size (the global batch the layouts are priced for)")
    pipeline = raw.get("pipeline") or {}
    cp_auto = ("context_parallel", "size") in autos
    choice = Choice(tp=None if ("tensor_parallel", "size") in autos else cfg.tensor_parallel.size,
                    pp=None if ("pipeline", "stages") in autos else cfg.pipeline.stages,
                    zero_stage=None if ("zero_optimization", "stage") in autos else cfg.zero_optimization.stage,
                    micro_batch=None if micro_auto else cfg.train_micro_batch_size_per_gpu,
                    schedule=pipeline.get("schedule"), virtual_stages=pipeline.get("virtual_stages"),
                    checkpointing=pipeline.get("activation_checkpointing"),
                    sequence_parallel=cfg.tensor_parallel.sequence_parallel,
                    hybrid_sharding=False, zeropp=False,  # "auto" sets the four keys above, not ZeRO++'s
                    ep=cfg.expert_parallel.size, etp=cfg.expert_parallel.expert_tensor_parallel_size, cp=None if cp_auto else cfg.context_parallel.size,
                    cp_method=_get(raw, "context_parallel", "method") if cp_auto else cfg.context_parallel.method)
    hw = _hardware(hints, world, device)
    with torch.device("meta"):
        shape_model = type(model)(copy.deepcopy(model.config))
    best, result = choose(Planner(shape_model, _workload(cfg, hints["seq_length"])), hw, choice)
    considered = result.considered
    if best is None:
        why = f" ({result.why_none()})" if result.refused or result.unpriced else ""
        raise ConfigError(f"\"auto\": none of the {considered} layouts of this model fits {world} devices of "
                          f"{hw.memory / 2**30:.1f} GiB at sequence length {hints['seq_length']} and global batch "
                          f"{cfg.train_batch_size}{why}; `zero3d plan` shows what does with other settings")
    layout = best.layout
    chosen = {("tensor_parallel", "size"): layout.tp, ("pipeline", "stages"): layout.pp,
              ("zero_optimization", "stage"): layout.zero_stage,
              (None, "train_micro_batch_size_per_gpu"): layout.micro_batch, ("context_parallel", "size"): layout.cp}
    for s, k in autos:
        _set(raw, s, k, chosen[s, k])
    if cp_auto:
        _set(raw, "context_parallel", "method", layout.cp_method)
    if ("tensor_parallel", "size") in autos and layout.etp != cfg.expert_parallel.expert_tensor_parallel_size:
        # the config's expert_tensor_parallel_size asked for experts split over tp, and the planner chose a
        # layout without (tp 1, or no expert parallelism): what it priced is the value the engine accepts
        _set(raw, "expert_parallel", "expert_tensor_parallel_size", layout.etp)
    if layout.pp > 1:
        raw.setdefault("pipeline", {}).update(schedule=layout.schedule, virtual_stages=layout.virtual_stages,
                                              activation_checkpointing=layout.checkpointing)
    logger.info("planner: %s for %s (predicted %.3f s per step, %.1f GiB on the fullest rank; %d layouts considered)",
                layout.describe(), ", ".join(_dotted(s, k) for s, k in autos), best.step_seconds, best.peak / 2**30,
                considered)
    return raw


def choose(planner, hw, choice):
    """The fastest layout that fits and that a config can express (activation checkpointing is a
    pipeline setting), and the search's result.

    In a process with a default process group (``initialize`` inside the user's job) the search
    runs in a child process: the planner prices tensor parallelism on a fake default group,
    which must never be made beside the job's own (``planner.fake_tp``)."""
    import torch.distributed as dist

    from parallel3d.planner.search import search

    if dist.is_available() and dist.is_initialized():
        return _choose_in_child(planner, hw, choice)
    result = search(planner, hw, choice, top=20)
    runnable = [p for p in result.best if p.layout.pp > 1 or not p.layout.checkpointing]
    return (runnable[0] if runnable else None), result


def _choose_in_child(planner, hw, choice):
    """`choose` for the same model class, config and workload in a fresh Python process (its
    ConfigError raised here); the inputs and the answer go through a temporary directory."""
    import pickle
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zero3d-plan-") as tmp:
        job, answer = Path(tmp) / "job.pkl", Path(tmp) / "answer.pkl"
        job.write_bytes(pickle.dumps((type(planner.model), planner.config, planner.workload, hw, choice)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        done = subprocess.run([sys.executable, "-m", "parallel3d.planner.auto", str(job), str(answer)], env=env,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0 or not answer.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"the planner's child process failed (exit {done.returncode}):\n{tail}")
        kind, value = pickle.loads(answer.read_bytes())
    if kind == "error":
        raise ConfigError(value)
    return value


def _child(job: Path, answer: Path) -> None:
    """The child process of `_choose_in_child`: no process group here."""
    import pickle

    from parallel3d.planner.predict import Planner

    model_class, config, workload, hw, choice = pickle.loads(job.read_bytes())
    with torch.device("meta"):
        model = model_class(config)
    try:
        out = ("ok", choose(Planner(model, workload), hw, choice))
    except ConfigError as exc:
        out = ("error", str(exc))
    answer.write_bytes(pickle.dumps(out))


if __name__ == "__main__":
    import sys

    _child(Path(sys.argv[1]), Path(sys.argv[2]))
