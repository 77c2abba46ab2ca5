"""The runners of ``scripts/bench_zero.py``: one training setup each, timed the same way.

Every runner is started in a fresh ``torchrun`` job (so its peak RSS is its own), builds
the same seeded Llama, trains it on the same seeded token batches with AdamW and gradient
clipping 1.0 in fp32, and has rank 0 write one JSON line of results.

A runner is ``setup(model, spec, stage) -> (step, model_state_bytes)``: ``step(ids)`` does one
forward, backward and optimizer step on a micro-batch of token ids; ``model_state_bytes()``
returns the bytes of model state this rank holds (Zero3D only; None elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()

# 25 MB of fp32 = DDP's default bucket_cap_mb; every runner with a bucket knob gets this size.
BUCKET_MB = float(os.environ.get("ZERO3D_BENCH_BUCKET_MB", "25"))  # bench_zero.py --bucket-mb
BUCKET_NUMEL = int(BUCKET_MB * 2**20 // 4)  # 6_553_600 elements at 25 MB
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold
MAX_LIVE = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0


@dataclass
class ModelSpec:
    """A benchmark model: the Llama config, the micro-batch shape and default step counts."""

    llama: dict
    micro: int
    seq: int
    steps: int
    warmup: int


MODELS = {
    # A: speed. ~13.7M params; compute and communication both matter.
    "A": ModelSpec(dict(vocab_size=2048, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4), micro=4, seq=256, steps=12, warmup=3),
    # B: memory. ~134M params (untied 32k embeddings); a small micro-batch so that model
    # states (params + grads + 2 Adam moments = 16 B/param in fp32) dominate memory.
    "B": ModelSpec(dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=12), micro=1, seq=128, steps=4, warmup=2),
    # H: model A at hidden 1024 (~55M params): tensor parallelism where the matmuls are larger.
    "H": ModelSpec(dict(vocab_size=2048, hidden_size=1024, intermediate_size=2752, num_hidden_layers=4,
                        num_attention_heads=16, num_key_value_heads=8), micro=4, seq=256, steps=6, warmup=2),
    # L: large for a CPU. ~254M params, bench_init.py's "254m" Llama: how costs grow with the model.
    "L": ModelSpec(dict(vocab_size=32000, hidden_size=1024, intermediate_size=2464, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16), micro=1, seq=128, steps=3, warmup=1),
    # P: bench_pipeline.py's model (8 blocks so that pp 4 has two chunks per rank, a small
    # vocabulary so that the head does not make the last stage heavy); bench_pp_replay.py.
    "P": ModelSpec(dict(vocab_size=256, hidden_size=256, intermediate_size=680, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=4), micro=2, seq=128, steps=5, warmup=2),
    # T: tiny, for the tests that run each benchmark path once.
    "T": ModelSpec(dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2), micro=2, seq=32, steps=1, warmup=1),
}


def model_spec(name: str) -> ModelSpec:
    """A benchmark model by name; ``NAME@SEQ`` is that model at sequence length SEQ, and
    ``NAME@SEQxMICRO`` also with MICRO sequences per micro-batch (equal tokens across models)."""
    base, _, shape = name.partition("@")
    match = re.fullmatch(r"([1-9]\d*)(?:x([1-9]\d*))?", shape)
    if base not in MODELS or (shape and match is None):
        raise ValueError(f"unknown benchmark model {name!r}: one of {', '.join(MODELS)}, optionally @SEQ (A@512) "
                         "or @SEQxMICRO (A@128x1)")
    if not shape:
        return MODELS[base]
    spec = dataclasses.replace(MODELS[base], seq=int(match[1]))
    return dataclasses.replace(spec, micro=int(match[2])) if match[2] else spec


def build_model(spec: ModelSpec) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**spec.llama, max_position_embeddings=max(spec.seq, 256))
    return LlamaForCausalLM(cfg).float().train()


def token_batches(spec: ModelSpec, rank: int, n: int) -> list[torch.Tensor]:
    """``n`` micro-batches of this rank's token ids (same for every runner)."""
    g = torch.Generator().manual_seed(1234 + rank)
    return [torch.randint(0, spec.llama["vocab_size"], (spec.micro, spec.seq), generator=g) for _ in range(n)]


def ds_config(spec: ModelSpec, stage: int) -> dict:
    """The DeepSpeed-format config given to both DeepSpeed and Zero3D."""
    return {
        "train_micro_batch_size_per_gpu": spec.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": BUCKET_NUMEL,
            "allgather_bucket_size": BUCKET_NUMEL,
            "stage3_prefetch_bucket_size": BUCKET_NUMEL,
            "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
            "stage3_max_live_parameters": MAX_LIVE,
        },
    }


# -- runners -------------------------------------------------------------------------------


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def setup_ddp(model, spec, stage):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model.to(_device()), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)

    def step(ids):
        ddp(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def fsdp2_model(model):
    """``fully_shard`` per decoder layer and at the root, over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(_device().type, (dist.get_world_size(),))
    model.to(_device())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def setup_fsdp2(model, spec, stage):
    model = fsdp2_model(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def import_deepspeed():
    """DeepSpeed, ready to run in this process group (``deepspeed.comm`` initialized)."""
    # Recipe of tests/ds_oracle.py: cpu accelerator (falls back to gloo), LOCAL_RANK set,
    # no JIT shared-memory op, torch.optim.AdamW via "torch_adam".
    import logging

    os.environ["DS_ACCELERATOR"] = _device().type
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def deepspeed_engine(model, spec, stage, config: dict | None = None):
    # No deepcopy of the model here: it would inflate DeepSpeed's peak RSS.
    deepspeed = import_deepspeed()
    return deepspeed.initialize(model=model, config=config or ds_config(spec, stage))[0]


def engine_step(engine):
    """One micro-batch through a DeepSpeed-style engine (DeepSpeed's or Zero3D's)."""

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    return step


def setup_deepspeed(model, spec, stage):
    return engine_step(deepspeed_engine(model, spec, stage)), lambda: None


def zero3d_engine(model, spec, stage):
    import parallel3d

    return parallel3d.initialize(model=model, config=ds_config(spec, stage))[0]


def setup_zero3d(model, spec, stage):
    engine = zero3d_engine(model, spec, stage)
    return engine_step(engine), engine.memory_report


def setup_zero3d_zero_options(model, spec, stage, **zero):
    """Zero3D with more ``zero_optimization`` keys: hybrid sharding (``mics_shard_size``), ZeRO++'s
    int8 collectives (``zero_quantized_weights``, ``zero_quantized_gradients``)."""
    import parallel3d

    config = ds_config(spec, stage)
    config["zero_optimization"].update(zero)
    engine = parallel3d.initialize(model=model, config=config)[0]
    return engine_step(engine), engine.memory_report


TP = 2  # tensor-parallel runners: tp 2 over dp world/2


def setup_zero3d_tp(model, spec, stage, sp=False):
    """``tensor_parallel.size`` 2 (with or without sequence parallel); every tp rank needs the same
    batch (``run(..., same_data=True)``)."""
    import parallel3d

    config = ds_config(spec, stage)
    config["tensor_parallel"] = {"size": TP, "sequence_parallel": sp}
    engine = parallel3d.initialize(model=model, config=config)[0]
    return engine_step(engine), engine.memory_report


PIPELINE_MICRO_BATCHES = 4  # per step and dp rank: 1F1B's steady state needs m >= pp


def setup_zero3d_pipeline(model, spec, stage, keep_full_gradients=False, schedule="1f1b", virtual_stages=1,
                          balance="parameters", stages=2, microbatches=PIPELINE_MICRO_BATCHES, record_timeline=False):
    """pp ``stages`` (1F1B by default) x dp world/stages: each step is ``microbatches`` copies of
    the batch. The step function carries the engine (``step.engine``) for timeline readers."""
    import parallel3d

    config = ds_config(spec, stage)
    config["gradient_accumulation_steps"] = microbatches
    config["pipeline"] = {"stages": stages, "schedule": schedule, "keep_full_gradients": keep_full_gradients,
                          "virtual_stages": virtual_stages, "balance": balance, "record_timeline": record_timeline}
    engine = parallel3d.initialize(model=model, config=config)[0]

    def step(ids):
        engine.train_batch(iter([{"input_ids": ids, "labels": ids}] * microbatches))

    step.engine = engine
    return step, engine.memory_report


RUNNERS = {
    "ddp": (setup_ddp, None),
    "fsdp2": (setup_fsdp2, 3),
    **{f"ds{s}": (setup_deepspeed, s) for s in (1, 2, 3)},
    **{f"z{s}": (setup_zero3d, s) for s in (0, 1, 2, 3)},
    **{f"z{s}-pp2": (setup_zero3d_pipeline, s) for s in (0, 1, 2, 3)},
    # hybrid sharding over groups of 2 (run with --nproc 4: 2 replicas of 2), and ZeRO++'s int8 collectives
    **{f"z{s}-mics2": (functools.partial(setup_zero3d_zero_options, mics_shard_size=2), s) for s in (1, 2, 3)},
    "z3-qwz-qgz": (functools.partial(setup_zero3d_zero_options, zero_quantized_weights=True,
                                     zero_quantized_gradients=True), 3),
    "ztp": (setup_zero3d_tp, 0),
    "ztp-sp": (functools.partial(setup_zero3d_tp, sp=True), 0),
    # stages 2-3 as before per-pass reduction: full gradients through the step
    **{f"z{s}-pp2-full": (functools.partial(setup_zero3d_pipeline, keep_full_gradients=True), s) for s in (2, 3)},
}


# -- measuring -----------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_over_ranks(rows: list[list[float]]) -> list[list[float]]:
    t = torch.tensor(rows, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def count_step(step, ids) -> dict:
    """One more step of a runner with every collective counted (functional ones, DTensor's,
    included; DDP's C++ reducer is not seen): calls, payload and ring wire bytes of this rank."""
    from parallel3d.runtime.comm_counter import count_collectives

    with count_collectives(functional=True) as comm:
        step(ids)
    return {"calls": comm.total("calls"), "nbytes": comm.total("nbytes"), "wire_bytes": comm.total("wire_bytes"),
            "by_op": {f"{r['group']}/{r['op']}": [r["calls"], r["nbytes"]] for r in comm.summary()}}


def run(names: list[str], model_name: str, steps: int, warmup: int, out_path: str,
        same_data: bool = False, count_comm: bool = False) -> None:
    """Body of one runner job (every rank); rank 0 appends one JSON line per runner to ``out_path``.

    One name: the runner alone in its processes, memory included. Several names
    (``--interleave``): each gets its own model and they take steps in turn (order reversed
    every step), so all see the same machine load; memory is then not per runner.
    ``same_data``: every rank gets rank 0's micro-batches (tensor parallelism: one tp group).
    ``count_comm``: after the timed steps, one more step per runner with its collectives
    counted (``count_step``), reported as ``comm`` (rank 0's).
    """
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = model_spec(model_name)
    batches = [b.to(_device()) for b in token_batches(spec, 0 if same_data else rank, warmup + steps)]
    runners, setup_s = {}, {}
    for name in names:
        setup, stage = RUNNERS[name]
        model = build_model(spec)
        n_params = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        runners[name] = setup(model, spec, stage)
        setup_s[name] = time.perf_counter() - t0
        del model  # the runner holds what it needs
    rss_setup, hwm_setup = _status_kib("VmRSS"), _status_kib("VmHWM")
    reset_ok = _reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = {name: ([], []) for name in names}  # wall, cpu
    for i, ids in enumerate(batches):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            runners[name][0](ids)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times[name][0].append(time.perf_counter() - t)
                times[name][1].append(time.process_time() - c)
    # A step lasts as long as its slowest rank; CPU seconds (all threads) of the busiest rank.
    times = {name: _max_over_ranks(list(wc)) for name, wc in times.items()}
    comm = {name: count_step(runners[name][0], batches[-1]) for name in names} if count_comm else {}
    alone = len(names) == 1
    for name in names:
        states = runners[name][1]()
        mem = torch.tensor([_status_kib("VmHWM") if reset_ok else -1, max(hwm_setup, _status_kib("VmHWM")), rss_setup,
                            sum(states.values()) if states else -1,
                            torch.cuda.max_memory_allocated() // 1024 if cuda else -1], dtype=torch.int64,
                           device=_device())
        gathered = [torch.zeros_like(mem) for _ in range(world)]
        dist.all_gather(gathered, mem)
        per_rank = lambda k, ok=True: [int(g[k]) for g in gathered] if ok else None  # noqa: E731
        if rank == 0:
            wall, cpu = times[name]
            result = {
                "runner": name, "model": model_name, "world": world, "params": n_params, "interleaved": not alone,
                "setup_s": setup_s[name], "step_s": wall, "median_s": statistics.median(wall), "cpu_s": cpu,
                "train_peak_kib": per_rank(0, alone and reset_ok), "peak_kib": per_rank(1, alone),
                "setup_rss_kib": per_rank(2, alone), "model_state_bytes": per_rank(3, bool(states)),
                "model_state_detail": states, "cuda_peak_kib": per_rank(4, alone and cuda),
                "spec": asdict(spec), "torch": torch.__version__, "comm": comm.get(name),
            }
            with open(out_path, "a") as f:
                f.write(json.dumps(result) + "\n")
    # Drop the runners while their process groups are still registered: DDP's C++ reducer can
    # hold the last reference to a group, and destroys it with the GIL held while the group's
    # worker thread waits for the GIL (torch 2.13: a deadlock, seen as a benchmark job that
    # never ends).
    runners.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
