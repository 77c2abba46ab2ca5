"""bf16 training of one Llama on one device: Zero3D against plain PyTorch, FSDP2 and DeepSpeed ZeRO-3.

    python scripts/bench_bf16_peers.py --out FILE.json [--model 1B] [--seq 2048] [--micro 2]
                                       [--steps 8] [--warmup 3] [--rounds 2] [--only a,b,...]
                                       [--compile-backend inductor]

One process, one rank (a process group of one, NCCL on CUDA, gloo on CPU). Every runner trains
the same seeded Llama on the same seeded token batches with AdamW and clipping 1.0, in bf16:

=====================  ============================================================================
runner                 what trains
=====================  ============================================================================
zero3d-z1 / -z3        ``parallel3d.initialize`` with ``bf16.enabled``, ZeRO stage 1 / 3
zero3d-z1/z3-compiled  the same with ``compile: {"enabled": true}`` (each block compiled)
torch                  the HF model in fp32 under ``torch.autocast(bfloat16)``, ``torch.optim.AdamW``
torch-compiled         the same with each decoder layer's forward compiled (torchtitan's regional compile)
fsdp2                  ``fully_shard`` per layer and at the root, bf16 params, fp32 reduction
deepspeed-z3           ``deepspeed.initialize`` with ``bf16.enabled``, ZeRO stage 3
=====================  ============================================================================

Eight 1B models' states (16 bytes a parameter each) do not fit one device together, so one
runner lives at a time: it is built, takes ``warmup`` untimed steps (the compiled runners
compile there), then ``steps`` timed ones, and is freed. Runners are interleaved over
``rounds`` rounds, odd rounds in reverse order (DeepSpeed always last: see below), and built
afresh in each (a compiled block's second build finds dynamo's cache warm), so a drifting clock
or a warming device weighs on all alike; step times are pooled over rounds.

Reported per runner: tokens/s (median step), MFU against the device's dense bf16 peak (model
FLOPs per token as torchtitan counts them: ``6 x non-embedding params + 12 x layers x heads x
head_dim x seq``), peak memory (on a GPU the CUDA allocator's peak above what was allocated when
the runner started, on CPU the peak RSS), the last loss. Above, because not every runner frees
all it allocated: a DeepSpeed ZeRO-3 engine and its model stay reachable after ``destroy()``
(closures of its hooks and a class-level ``lru_cache`` in its parameter coordinator hold them),
so the runners after it start with its memory still allocated (``baseline_bytes``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_runners import ADAMW, CLIP, _reset_peak_rss, _status_kib, import_deepspeed  # noqa: E402

_LINEAR = torch.nn.functional.linear
"""DeepSpeed's ZeRO-3 replaces ``torch.nn.functional.linear`` for the rest of the process (its
memory-efficient linear, "persists unless manually reset"); every runner starts with torch's."""

RUNNERS = ("zero3d-z1", "zero3d-z1-compiled", "zero3d-z3", "zero3d-z3-compiled", "torch", "torch-compiled", "fsdp2",
           "deepspeed-z3")

PEAK_BF16_FLOPS = {  # dense bf16 tensor-core peak by device-name fragment (vendor datasheets)
    "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "GH200": 989e12,
    "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12, "B200": 2250e12,
}


@dataclass(frozen=True)
class Shape:
    """A Llama config and its micro-batch."""

    llama: dict
    seq: int
    micro: int


SHAPES = {
    # TinyLlama-1.1B's shape (1.10B parameters, untied 32k vocabulary, grouped-query attention)
    "1B": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    # the CPU-sized variant of the suite
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def peak_flops(dev: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (a CPU)."""
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def build_model(shape: Shape) -> torch.nn.Module:
    """The seeded Llama in fp32, built on the device (random init there: seconds, not minutes, for 1B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape.llama, max_position_embeddings=max(shape.seq, 256), attention_dropout=0.0,
                      use_cache=False)
    with device():
        return LlamaForCausalLM(cfg).float().train()


def flops_per_token(shape: Shape, model: torch.nn.Module) -> float:
    """torchtitan's count: 6 per non-embedding parameter and token, plus attention's 12 x l x h x q x t."""
    cfg = model.config
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 6 * params + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * shape.seq


def ds_style_config(shape: Shape, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": shape.micro, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 10**9, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def compile_layers(model: torch.nn.Module, backend: str) -> None:
    """torchtitan's regional compile on a plain model: each decoder layer's forward."""
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, backend=backend)


def setup(name: str, model: torch.nn.Module, shape: Shape, backend: str):
    """``(step(ids) -> loss, close())`` of one runner."""
    if name.startswith("zero3d"):
        import parallel3d

        config = ds_style_config(shape, 3 if "-z3" in name else 1)
        if name.endswith("-compiled"):
            config["compile"] = {"enabled": True, "backend": backend}
        engine = parallel3d.initialize(model=model, config=config)[0]
        return _engine_step(engine), engine.destroy
    if name == "deepspeed-z3":
        engine = import_deepspeed().initialize(model=model, config=ds_style_config(shape, 3))[0]
        return _engine_step(engine), engine.destroy
    if name.startswith("torch"):
        if name == "torch-compiled":
            compile_layers(model, backend)
        return _plain_step(model, _autocast), lambda: None
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device().type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return _plain_step(model, contextlib.nullcontext), lambda: None
    raise ValueError(f"unknown runner {name!r}; one of {', '.join(RUNNERS)}")


def _autocast():
    return torch.autocast(device().type, dtype=torch.bfloat16)


def _engine_step(engine):
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _plain_step(model: torch.nn.Module, autocast):
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(ids: torch.Tensor) -> torch.Tensor:
        with autocast():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_one(name: str, shape: Shape, batches: list[torch.Tensor], warmup: int, backend: str) -> dict:
    """Build, warm up, time and free one runner; its step times, peak memory and last loss."""
    torch.nn.functional.linear = _LINEAR
    gc.collect()
    baseline = 0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    rss_reset = _reset_peak_rss()
    t0 = time.perf_counter()
    model = build_model(shape)
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_token(shape, model)
    step, close = setup(name, model, shape, backend)
    del model
    setup_s = time.perf_counter() - t0
    times, loss = [], None
    for i, ids in enumerate(batches):
        _sync()
        t = time.perf_counter()
        loss = step(ids)
        _sync()
        if i == warmup - 1:
            warm_s = time.perf_counter() - t0 - setup_s
        if i >= warmup:
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() - baseline if torch.cuda.is_available() else (
        _status_kib("VmHWM") * 1024 if rss_reset else None)
    row = {"runner": name, "params": n_params, "flops_per_token": flops, "setup_s": setup_s, "warmup_s": warm_s,
           "step_s": times, "peak_bytes": peak, "baseline_bytes": baseline, "last_loss": float(loss)}
    close()
    del step, close
    gc.collect()
    return row


def summarize(rows: list[dict], shape: Shape, dev: torch.device) -> list[dict]:
    """One entry per runner: its rounds pooled."""
    peak = peak_flops(dev)
    out = []
    for name in dict.fromkeys(r["runner"] for r in rows):
        mine = [r for r in rows if r["runner"] == name]
        if any("error" in r for r in mine):
            out.append({"runner": name, "error": next(r["error"] for r in mine if "error" in r)})
            continue
        median = statistics.median(t for r in mine for t in r["step_s"])
        tokens_s = shape.micro * shape.seq / median
        achieved = tokens_s * mine[0]["flops_per_token"]
        out.append({"runner": name, "tokens_per_s": tokens_s, "median_step_s": median,
                    "mfu": achieved / peak if peak else None, "achieved_tflops": achieved / 1e12,
                    "peak_bytes": max((r["peak_bytes"] or 0) for r in mine) or None,
                    "last_loss": mine[-1]["last_loss"], "setup_s": mine[0]["setup_s"],
                    "first_warmup_s": mine[0]["warmup_s"], "params": mine[0]["params"], "rounds": len(mine),
                    "steps_timed": sum(len(r["step_s"]) for r in mine)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="write the results here (JSON)")
    ap.add_argument("--model", default="1B", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per runner and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(RUNNERS))
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--budget-s", type=float, help="start no runner that would end after this many seconds")
    args = ap.parse_args(argv)
    names = args.only.split(",")
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        ap.error(f"unknown runner(s) {', '.join(unknown)}; allowed: {', '.join(RUNNERS)}")
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the compiled runners compile in the first step)")
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    os.environ.update({k: v for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"),
                                          ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")) if k not in os.environ})
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    shape = Shape(SHAPES[args.model], args.seq, args.micro)
    g = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, shape.llama["vocab_size"], (shape.micro, shape.seq), generator=g).to(dev)
               for _ in range(args.warmup + args.steps)]
    rows, start, took = [], time.perf_counter(), {}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        # DeepSpeed last in every round: its engine is never freed (see the module), so before the others
        # it would leave its memory to every later runner of the round
        for name in [n for n in order if n != "deepspeed-z3"] + [n for n in order if n == "deepspeed-z3"]:
            # a runner whose last run (or, unseen, the slowest so far) would end past the budget is not started
            expected = took.get(name, max(took.values(), default=0.0))
            if args.budget_s and time.perf_counter() - start + expected > args.budget_s:
                print(f"{name}: not started in round {r + 1}, {expected:.0f} s would exceed --budget-s", flush=True)
                continue
            t = time.perf_counter()
            try:
                rows.append(run_one(name, shape, batches, args.warmup, args.compile_backend))
            except Exception as exc:  # noqa: BLE001 - one runner's failure is reported, the others still run
                rows.append({"runner": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            took[name] = time.perf_counter() - t
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "step_s"}), flush=True)
            write(args, rows, shape, dev)  # after every runner: a part killed at its timeout keeps what it measured
    dist.destroy_process_group()
    return 0


def write(args, rows: list[dict], shape: Shape, dev: torch.device) -> None:
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result = {"device": device_name, "peak_bf16_flops": peak_flops(dev), "torch": torch.__version__,
              "shape": asdict(shape), "model": args.model, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds, "compile_backend": args.compile_backend,
              "runners": summarize(rows, shape, dev), "raw": rows}
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    sys.exit(main())
