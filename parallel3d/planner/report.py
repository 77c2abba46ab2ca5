"""What ``zero3d plan`` prints around its table: the assumed devices first, a legend of the columns
and of the layout names, and the config of the chosen layout in DeepSpeed JSON keys, ready to
paste into a ds_config.json (or a job's ``engine`` section)."""

from __future__ import annotations

import json

PRECISION_KEYS = {"bf16": "bf16", "fp16": "fp16"}

LEGEND = """\
columns: peak GiB = predicted peak memory of the fullest rank; states = its model states (parameters,
  gradients, optimizer states, as memory_report() counts them); step s = predicted time of one optimizer
  step; fwd+bwd s = the forward and backward passes of all micro-batches, pipeline bubble included;
  dp comm = data-parallel gradient/parameter traffic not hidden behind compute; tokens/s = global batch
  x seq len / step s; TFLOP/s = FLOPs counted per device and second (recomputation included).
layout: pp pipeline stages, dp data-parallel replicas, cpN-method context parallelism (each sequence split over N
  ranks, Ulysses or ring; context_parallel), tp tensor-parallel size, epE expert parallelism (each MoE
  layer's experts split over E of the ranks ZeRO shards over; expert_parallel.autoep_size; etpT: each expert also
  split over the T tp ranks, expert_tensor_parallel_size), z ZeRO stage (z3++: ZeRO++,
  int8 parameter gathers and gradient reductions and hpZ over a node; its rounding is in docs/deepspeed.md), hsS hybrid
  sharding (ZeRO inside groups of S data-parallel ranks, a node's or a few nodes'; mics_shard_size), mb micro-batch
  per device; then the pipeline schedule (gpipe, 1f1b, interleaved_1f1b, zb_h1 = zero-bubble), vN = N model
  chunks per rank (interleaved), ac = activation checkpointing, sp = sequence parallelism."""


def header(hw, precision: str, seq: int, global_batch: int) -> str:
    """The devices the predictions assume, before the table."""
    return (f"assuming {hw.gpus} x {hw.name} ({hw.memory / 1e9:.0f} GB, {hw.gpus_per_node} per node, "
            f"{hw.peak_flops / 1e12:.0f} TFLOP/s peak at {hw.compute_efficiency:.0%} efficiency, "
            f"{hw.memory_bandwidth / 1e12:.2f} TB/s memory, NVLink {hw.nvlink.bandwidth / 1e9:.0f} GB/s, "
            f"network {hw.network.bandwidth / 1e9:.0f} GB/s per GPU); {precision}, seq len {seq}, "
            f"global batch {global_batch}")


def layout_config(layout, global_batch: int, precision: str) -> dict:
    """The layout as DeepSpeed JSON keys (Zero3D's tensor_parallel / pipeline sections for the mesh)."""
    config: dict = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.microbatches(global_batch),
    }
    if precision in PRECISION_KEYS:
        config[PRECISION_KEYS[precision]] = {"enabled": True}
    config["zero_optimization"] = {"stage": layout.zero_stage}
    if getattr(layout, "shard", None):
        config["zero_optimization"]["mics_shard_size"] = layout.shard
    if getattr(layout, "zeropp", 0):
        config["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True)
        if layout.zeropp > 1:
            config["zero_optimization"]["zero_hpz_partition_size"] = layout.zeropp
    if getattr(layout, "ep", 1) > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": layout.ep}
        if getattr(layout, "etp", 1) > 1:
            config["expert_parallel"]["expert_tensor_parallel_size"] = layout.etp
    if getattr(layout, "cp", 1) > 1:
        config["context_parallel"] = {"size": layout.cp, "method": layout.cp_method}
    if layout.tp > 1:
        config["tensor_parallel"] = {"size": layout.tp}
        if layout.sequence_parallel:
            config["tensor_parallel"]["sequence_parallel"] = True
    if layout.pp > 1:
        config["pipeline"] = {"stages": layout.pp, "schedule": layout.schedule}
        if layout.virtual_stages > 1:
            config["pipeline"]["virtual_stages"] = layout.virtual_stages
        if layout.checkpointing:
            config["pipeline"]["activation_checkpointing"] = True
    return config


def snippet(layout, global_batch: int, precision: str) -> str:
    """The chosen layout's config to paste, with a note where a setting is not a config key."""
    text = (f"config of #1 ({layout.describe()}), DeepSpeed JSON keys:\n"
            + json.dumps(layout_config(layout, global_batch, precision), indent=2))
    if layout.checkpointing and layout.pp == 1:
        text += ("\n(activation checkpointing without pipeline stages is not a config key: call "
                 "model.gradient_checkpointing_enable() before initialize)")
    return text
