"""Zero3D's CUDA paths on the GPUs of one machine, checked against a plain PyTorch run.

    torchrun --nproc-per-node N scripts/gpu_check.py [--model A] [--backend nccl|gloo] [--json FILE]

Every rank trains the benchmark Llama of ``scripts/bench_runners.py`` (fp32 AdamW, clipping
1.0) for a few steps in each case below and compares the dp-mean losses and the final
parameters with one process that trains on the same global batch with ``torch.optim.AdamW`` on
the same device (computed on every rank). Cases: ZeRO 0-3; ZeRO-Offload of the optimizer
states at stages 2 and 3 (and of the parameter shards at stage 3 when there are several
ranks); a model started on the meta device at stage 3; bf16 at stages 1 and 3 (losses near
the fp32 oracle's); a checkpoint saved, then resumed by a fresh engine (bit for bit); with
several ranks also tensor parallelism and 1F1B pipeline stages over all of them. One row
per case: the largest relative errors, the model-state bytes ``memory_report`` counts on the
device against the ZeRO paper's formula, and the CUDA peak. Exit status 1 if a case fails.

NCCL refuses two ranks of one communicator on the same GPU, so with one GPU the NCCL run has
one rank; ``--backend gloo`` puts several ranks on one GPU through gloo's CUDA collectives,
which runs the multi-rank code (sharding, offload's host copies, tensor parallelism) on CUDA tensors but
not NCCL, nor pipeline stages (gloo cannot send CUDA tensors point to point).
Runs on CPU too (gloo), as a dry run of the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_runners import ADAMW, CLIP, build_model, ds_config, model_spec, token_batches  # noqa: E402

STEPS = 4
FP32_RTOL = 1e-5  # the CPU parity tests' tolerance
BF16_LOSS_RTOL = 2e-2  # bf16 keeps ~3 significant digits
NOISE_FLOOR = 1e-4  # a gradient entry below this times its tensor's RMS has a sign set by rounding
SMALL = {"reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000, "stage3_prefetch_bucket_size": 500_000}
OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
SHARD_ALL = {"stage3_param_persistence_threshold": 0}


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def global_batches(spec, world: int) -> list[list[torch.Tensor]]:
    """``batches[step][rank]``: every rank's micro-batch of every step, on this device."""
    per_rank = [token_batches(spec, r, STEPS) for r in range(world)]
    return [[per_rank[r][s].to(device()) for r in range(world)] for s in range(STEPS)]


def oracle(spec, batches) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process over the global batch: per-step mean losses, final parameters, and the
    entries whose gradient was at some step within rounding noise of zero (``NOISE_FLOOR``)."""
    model = build_model(spec).to(device())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, noisy = [], {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters()}
    for step in batches:
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in step) / len(step)
        loss.backward()
        for n, p in model.named_parameters():
            noisy[n] |= p.grad.abs() < NOISE_FLOOR * p.grad.pow(2).mean().sqrt()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, noisy


def meta_model(spec) -> LlamaForCausalLM:
    """``build_model``'s model, built on the meta device (its values come from ``initialize``)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**spec.llama, max_position_embeddings=max(spec.seq, 256))
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).float().train()


def engine_for(spec, stage: int, extra: dict, bf16: bool = False, meta: bool = False, layout: dict | None = None):
    import parallel3d

    config = ds_config(spec, stage)
    config["zero_optimization"].update({**SMALL, **extra})
    config.update(layout or {})
    if bf16:
        config["bf16"] = {"enabled": True}
    model = meta_model(spec) if meta else build_model(spec)
    return parallel3d.initialize(model=model, config=config)[0]


def train(engine, batches) -> list[float]:
    rank = dist.get_rank()
    losses = []
    for step in batches:
        loss = engine(input_ids=step[rank], labels=step[rank]).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
              noisy: dict[str, torch.Tensor] | None = None) -> float:
    """Largest norm-wise relative error ``||got - want|| / ||want||`` of any parameter, the CPU
    tests' measure (a pipeline stage's parameters only: ``got`` may hold a subset of ``want``).

    ``noisy`` entries are left out: where the exact gradient is about zero its computed sign is
    rounding noise, which Adam turns into a step of about ``lr`` either way, so two correct
    runs that sum in different orders (tensor parallelism's split matmuls) disagree there.
    """
    def error(n: str, g: torch.Tensor) -> float:
        keep = ~noisy[n] if noisy is not None else torch.ones_like(want[n], dtype=torch.bool)
        diff = (g.to(want[n].device).float() - want[n])[keep]
        return (diff.norm() / want[n][keep].norm().clamp_min(1e-30)).item()

    worst = max((error(n, g), n) for n, g in got.items())
    if worst[0] >= FP32_RTOL:
        logging.getLogger(__name__).warning("parameter %s differs by %.2e", worst[1], worst[0])
    return worst[0]


def loss_error(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def state_bytes(engine) -> int:
    """Model-state bytes on the device (offloaded ones are host memory)."""
    return sum(v for k, v in engine.memory_report().items() if not k.startswith("offloaded"))


def paper_bytes(stage: int, n_params: int, world: int, extra: dict) -> float:
    """fp32 with Adam: params 4, gradients 4, moments 8 bytes per parameter, each sharded from
    its stage on (the fp32 master is the working parameter). Offloaded moments and parameter
    shards are host memory."""
    per = {0: 4 + 4 + 8, 1: 4 + 4 + 8 / world, 2: 4 + (4 + 8) / world, 3: 16 / world}[stage]
    if "offload_optimizer" in extra:
        per -= 8 / world
    if "offload_param" in extra:
        per -= 4 / world
    return per * n_params


def case_fp32(spec, batches, oracles, stage, extra, meta=False):
    engine = engine_for(spec, stage, extra, meta=meta)
    losses = train(engine, batches)
    params = engine.full_parameters()
    want = oracles("global")
    errors = {"loss": loss_error(losses, want[0]), "params": rel_error(params, want[1], want[2])}
    n = sum(p.numel() for p in params.values())
    memory = {"state_bytes": state_bytes(engine),
              "paper_bytes": paper_bytes(stage, n, dist.get_world_size(), extra)}
    ok = errors["loss"] < FP32_RTOL and errors["params"] < FP32_RTOL
    return ok, errors, memory


def case_bf16(spec, batches, oracles, stage, extra):
    engine = engine_for(spec, stage, extra, bf16=True)
    losses = train(engine, batches)
    errors = {"loss": loss_error(losses, oracles("global")[0])}
    return errors["loss"] < BF16_LOSS_RTOL, errors, {"state_bytes": state_bytes(engine)}


def case_resume(spec, batches, oracles, stage, extra):
    """Save after two steps; a fresh engine that loads it must take the next steps identically."""
    directory = os.path.join(tempfile.gettempdir(), f"zero3d_gpu_check_{os.environ.get('MASTER_PORT', '0')}")
    first = engine_for(spec, stage, extra)
    train(first, batches[:2])
    first.save_checkpoint(directory)
    straight = train(first, batches[2:])
    params = first.full_parameters()
    second = engine_for(spec, stage, extra)
    second.load_checkpoint(directory)
    resumed = train(second, batches[2:])
    errors = {"loss": loss_error(resumed, straight), "params": rel_error(second.full_parameters(), params)}
    return resumed == straight and errors["params"] == 0.0, errors, {}


def case_tp(spec, batches, oracles, stage, extra):
    """Tensor parallelism over every rank (dp 1): each rank takes rank 0's micro-batch."""
    engine = engine_for(spec, stage, extra, layout={"tensor_parallel": {"size": dist.get_world_size()}})
    losses = []
    for step in batches:
        loss = engine(input_ids=step[0], labels=step[0]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    want = oracles("rank0")
    errors = {"loss": loss_error(losses, want[0]), "params": rel_error(engine.full_parameters(), want[1], want[2]),
              "noisy_entries": int(sum(m.sum() for m in want[2].values()))}
    return errors["loss"] < FP32_RTOL and errors["params"] < FP32_RTOL, errors, {"state_bytes": state_bytes(engine)}


def case_pipeline(spec, batches, oracles, stage, extra):
    """Pipeline stages over every rank (dp 1, 1F1B): every rank's micro-batch is one of the step's."""
    world = dist.get_world_size()
    engine = engine_for(spec, stage, extra, layout={"pipeline": {"stages": world, "schedule": "1f1b"},
                                                    "gradient_accumulation_steps": world})
    losses = [float(engine.train_batch(iter([{"input_ids": ids, "labels": ids} for ids in step]))) for step in batches]
    want = oracles("global")
    errors = {"loss": loss_error(losses, want[0]), "params": rel_error(engine.full_parameters(), want[1], want[2])}
    return errors["loss"] < FP32_RTOL and errors["params"] < FP32_RTOL, errors, {"state_bytes": state_bytes(engine)}


def cases(world: int, pipelines: bool = True) -> list[tuple]:
    """``pipelines``: False where the process group cannot send this device's tensors point to
    point (gloo with CUDA tensors; initialize refuses that layout)."""
    listed = [(f"z{s} fp32", case_fp32, s, dict(SHARD_ALL) if s == 3 else {}) for s in range(4)]
    listed += [("z2 offload_optimizer", case_fp32, 2, OFFLOAD_OPT),
               ("z3 offload_optimizer", case_fp32, 3, {**OFFLOAD_OPT, **SHARD_ALL})]
    if world > 1:
        listed.append(("z3 offload_param+optimizer", case_fp32, 3,
                       {**OFFLOAD_OPT, "offload_param": {"device": "cpu", "pin_memory": True}, **SHARD_ALL}))
    listed.append(("z3 meta-device start", lambda *a: case_fp32(*a, meta=True), 3, SHARD_ALL))
    listed += [(f"z{s} bf16", case_bf16, s, SHARD_ALL if s == 3 else {}) for s in (1, 3)]
    listed += [(f"z{s} save+resume", case_resume, s, SHARD_ALL if s == 3 else {}) for s in (2, 3)]
    if world > 1:
        listed.append((f"tp{world} z1", case_tp, 1, {}))
    if world > 1 and pipelines:
        listed.append((f"pp{world} 1f1b z1", case_pipeline, 1, {}))
    return listed


def run_checks(model: str, json_path: str | None = None, only: list[str] | None = None) -> list[dict]:
    """Every case on this rank (or the ones labelled in ``only``), in the current process group;
    rank 0 prints a row per case (and appends it to ``json_path``). Returns this rank's results."""
    dev = device()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = model_spec(model)
    batches = global_batches(spec, world)
    oracles = functools.cache(lambda which: oracle(spec, batches if which == "global" else [s[:1] for s in batches]))
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        print(f"{name}, torch {torch.__version__}, backend {dist.get_backend()}, {world} rank(s), model {model}")
        print(f"{'case':28} {'ok':4} {'loss err':>9} {'param err':>9} {'states MiB':>10} {'paper MiB':>9} "
              f"{'CUDA peak MiB':>13}")
    results = []
    listed = cases(world, pipelines=not (dev.type == "cuda" and dist.get_backend() == "gloo"))
    unknown = set(only or ()) - {c[0] for c in listed}
    if unknown:
        raise SystemExit(f"gpu_check: no case {', '.join(sorted(unknown))} at world {world}; the cases: "
                         f"{', '.join(c[0] for c in listed)}")
    for label, run_case, stage, extra in [c for c in listed if only is None or c[0] in only]:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            ok, errors, memory = run_case(spec, batches, oracles, stage, extra)
            error = None
        except Exception:  # noqa: BLE001 - one case's failure is reported, the others still run
            ok, errors, memory, error = False, {}, {}, traceback.format_exc()
        peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else float("nan")
        results.append({"case": label, "ok": ok, "errors": errors, "memory": memory, "cuda_peak_mib": peak,
                        "world": world, "backend": dist.get_backend(), "model": model, "torch": torch.__version__,
                        "error": error})
        if rank == 0:
            mib = lambda key: f"{memory[key] / 2**20:.1f}" if key in memory else "-"  # noqa: E731
            err = lambda key: f"{errors[key]:.1e}" if key in errors else "-"  # noqa: E731
            print(f"{label:28} {'yes' if ok else 'NO':4} {err('loss'):>9} {err('params'):>9} {mib('state_bytes'):>10} "
                  f"{mib('paper_bytes'):>9} {peak:13.1f}", flush=True)
            if error:
                print(error, flush=True)
            if json_path:
                with open(json_path, "a") as f:
                    f.write(json.dumps(results[-1]) + "\n")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="A", help="benchmark model (scripts/bench_runners.py), e.g. A or T")
    ap.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on CPU")
    ap.add_argument("--json", help="append one JSON line per case here (rank 0)")
    ap.add_argument("--cases", help="comma-separated case labels to run (default: all), e.g. 'z3 fp32,z1 bf16'")
    args = ap.parse_args()
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(args.backend or ("nccl" if dev.type == "cuda" else "gloo"))
    results = run_checks(args.model, args.json, args.cases.split(",") if args.cases else None)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    exit_now(main())
