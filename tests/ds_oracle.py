"""DeepSpeed as a numerical test oracle on CPU (gloo), ZeRO stages 0-3, fp32.

Not a test file: call these from inside a process group the test already made,
e.g. torch.multiprocessing.spawn + dist.init_process_group("gloo", ...).

Facts found by experiment (deepspeed 0.19.8, torch 2.13 CPU, 2 ranks):
* DS_ACCELERATOR=cpu must be set before ``import deepspeed``. The CPU accelerator
  picks the "ccl" backend only if oneccl_bindings_for_pytorch is importable (it
  is not installed here); otherwise it falls back to gloo. An already
  initialised default group is reused as is (deepspeed wraps it, no re-init).
* deepspeed.initialize asserts that LOCAL_RANK is in os.environ (normally set by
  its launcher); we set it to the global rank (single host).
* deepspeed's TorchBackend JIT-compiles a C++ shared-memory all-reduce op
  (ninja + g++, ~50 s cold, cached in ~/.cache/torch_extensions) although it is
  only used for inference_all_reduce and only when LOCAL_SIZE is set. We stub
  build_shm_op -> None: no compile, no /dev/shm segments shared between runs.
* optimizer {"type": "AdamW"} maps to deepspeed FusedAdam (another JIT compile,
  ~60 s cold) unless params contain "torch_adam": true, which gives plain
  torch.optim.AdamW (exact torch semantics). torch AdamW is on ZeRO's supported
  list, so "zero_allow_untested_optimizer" is NOT needed;
  "zero_force_ds_cpu_optimizer" only matters with offload_optimizer + a client
  optimizer, so it is not needed either.
* fp32 (no fp16/bf16 section) works for all stages, including ZeRO-3 on CPU.
* engine.backward scales the loss by 1/gas and gradients are averaged over
  ranks, so with equal-size micro-batches (same token count, no -100 labels) a
  step equals one torch step on the concatenated global batch with
  clip_grad_norm_(1.0) + torch.optim.AdamW: losses agree to ~1.5e-7 rel for
  stages 0-3 (Llama and tied-embedding GPT2). Adam is nearly scale-invariant:
  a wrong grad scale (sum vs mean) only shows through clipping/eps, ~1e-4 rel
  in 5 steps at lr 1e-2 -- keep lr large and the grad norm above the clip.
* Dropout must be 0 (GPT2Config defaults to 0.1 and a freshly built HF model
  is in train mode), otherwise nothing is comparable: we refuse it.
* ZeRO-3 partitions the model's parameters in place (p.data becomes empty), so
  we train a deepcopy and leave the caller's model untouched.
"""
import copy
import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402,F401

# `deepspeed.comm.torch` as an attribute is the torch package; go via sys.modules.
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.utils.logger.setLevel(logging.WARNING)


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator reports fp16 as unsupported (its fused kernels are not built for
    it) and initialize refuses; the ZeRO optimizers and the loss scaler run on CPU all the same."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def _prepare_config(config: dict, micro_batches: list) -> dict:
    cfg = copy.deepcopy(config)
    cfg.setdefault("train_micro_batch_size_per_gpu", int(micro_batches[0]["input_ids"].shape[0]))
    cfg.setdefault("steps_per_print", 10**9)
    opt = cfg.get("optimizer")
    if opt is not None and opt.get("type", "").lower() in ("adam", "adamw"):
        # torch.optim.AdamW instead of a JIT-compiled FusedAdam (see module doc).
        opt.setdefault("params", {}).setdefault("torch_adam", True)
    return cfg


def _forget_cached_groups() -> None:
    """Drop the process groups DeepSpeed caches in module globals.

    The test harness destroys every sub-group after each call, so a group DeepSpeed cached
    during an earlier call is dead by the next one; DeepSpeed recreates them on demand.
    """
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None
    groups._DATA_PARALLEL_GROUP = None
    groups._MODEL_PARALLEL_GROUP = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    for cache in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP, groups._ALL_TO_ALL_GROUP):
        cache.clear()


def make_engine(model: torch.nn.Module, config: dict, micro_batches: list):
    """deepspeed.initialize on a deepcopy of `model` inside the existing group."""
    if not dist.is_initialized():
        raise RuntimeError("ds_oracle needs an initialised default process group")
    bad = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if bad:
        raise ValueError(f"dropout > 0 makes DeepSpeed incomparable with torch: {bad[:3]}")
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    _forget_cached_groups()
    engine, _, _, _ = deepspeed.initialize(model=copy.deepcopy(model),
                                           config=_prepare_config(config, micro_batches))
    return engine


def deepspeed_full_params(engine) -> dict:
    """Full (unpartitioned) parameters, name -> cpu fp32 tensor, on every rank.

    Tied weights appear once (named_parameters de-duplicates them)."""
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out[name] = p.detach().to("cpu", torch.float32).clone()
    return out


def deepspeed_losses(model: torch.nn.Module, config: dict, micro_batches: list[dict],
                     return_params: bool = False) -> list[float]:
    """Train with DeepSpeed; return per-optimizer-step losses (mean over the gas
    micro-batches and over ranks, identical on every rank).

    Each rank passes its own micro-batches (dicts with input_ids/labels);
    len(micro_batches) = steps * gradient_accumulation_steps. With
    return_params=True returns (losses, deepspeed_full_params(engine))."""
    engine = make_engine(model, config, micro_batches)
    gas = engine.gradient_accumulation_steps()
    if len(micro_batches) % gas:
        raise ValueError(f"{len(micro_batches)} micro-batches is not a multiple of gas={gas}")
    local = []
    try:
        for i, mb in enumerate(micro_batches):
            loss = engine(**mb).loss
            engine.backward(loss)
            engine.step()  # no-op except at gas boundaries
            if i % gas == 0:
                local.append(0.0)
            local[-1] += loss.item() / gas
        t = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(t)
        losses = (t / dist.get_world_size()).tolist()
        params = deepspeed_full_params(engine) if return_params else None
    finally:
        engine.destroy()
    return (losses, params) if return_params else losses
