"""Memory of LoRA fine-tuning: the frozen base sharded at ZeRO-3, against the same run with the
base whole (ZeRO-2) and against DeepSpeed ZeRO-3 with the same peft model (issue 29).

    python scripts/bench_lora.py [--model B|254m] [--nproc 4] [--steps 3] [--only z3,z2,ds3]

Each runner is its own ``torchrun --standalone`` job (fresh processes, so a peak is its own):

| runner | what every rank does |
|---|---|
| z3 | Llama built on the meta device, ``get_peft_model`` (rank-8 LoRA on q, v, down), ``initialize(..., pretrained=DIR)`` at ZeRO-3: each rank reads its slices of the base |
| z3-p1 | z3 with ``stage3_prefetch_bucket_size: 1``: prefetch one fetch module ahead (the default budget, DeepSpeed's 5e7 elements, gathers several blocks ahead) |
| z2 | the same at ZeRO-2: the frozen base whole on every rank |
| ds3 | DeepSpeed: the Llama built inside ``deepspeed.zero.Init`` (partitioned as it is built), ``get_peft_model``, ``deepspeed.initialize`` with the adapters as its parameters (ZeRO-3) |

Reported per runner, the maximum over ranks of: *base bytes* = the frozen base's bytes the rank
keeps between uses (Zero3D: ``memory_report()["frozen_params"]``; DeepSpeed: its partitions,
``ds_tensor``), *state* = the rest of ``memory_report()`` (adapters, their gradients and
optimizer states), *before* = RSS after start-up and one warm-up step, *peak* = peak RSS (VmHWM,
reset at that point) over the training steps, *peak - before* what the steps add, and *step* =
mean seconds per step (on a shared CPU machine: a rough figure). The target:
at ZeRO-3 the base bytes are 1/nproc of the whole base (plus padding), and the step's peak
adds at most two blocks' gathered base over that.
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
from bench_runners import MODELS as BENCH_MODELS  # noqa: E402

MODELS = {"B": BENCH_MODELS["B"].llama, "254m": BENCH_MODELS["L"].llama}  # the benchmarks' 134M and 254M Llamas
ALL = ["z3", "z3-p1", "z2", "ds3"]
TARGETS = ["q_proj", "v_proj", "down_proj"]
SEQ, MICRO = 128, 1


def parse_args(argv=None):
    ap = runner_parser(__doc__, ALL, "B", sorted(MODELS), 4)
    ap.add_argument("--steps", type=int, default=3)
    return ap.parse_args(argv)


def llama_config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS[name], max_position_embeddings=SEQ, tie_word_embeddings=False)


def engine_config(stage: int, world: int, **zero) -> dict:
    return {"train_batch_size": MICRO * world, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 10**9}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)


# -- runners (inside torchrun) ---------------------------------------------------------------


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _zero3d(cfg, stage: int, directory: str, world: int, **zero):
    import torch
    from peft import get_peft_model

    import parallel3d

    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = get_peft_model(LlamaForCausalLM(cfg), lora_config())
    engine = parallel3d.initialize(model=model, config=engine_config(stage, world, **zero), pretrained=directory)[0]

    def step(ids):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def report():
        r = engine.memory_report()
        return r["frozen_params"], sum(v for k, v in r.items() if k != "frozen_params")

    return step, report


def _deepspeed(cfg, world: int):
    import logging

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    config = engine_config(3, world)
    with deepspeed.zero.Init(config_dict_or_path=config):
        base = LlamaForCausalLM(cfg)
    model = get_peft_model(base, lora_config())
    trained = [p for p in model.parameters() if p.requires_grad]
    engine = deepspeed.initialize(model=model, config=config, model_parameters=trained)[0]
    frozen = [p for p in model.parameters() if not p.requires_grad]

    def step(ids):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def report():
        held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
                   else p.numel() * p.element_size() for p in frozen)
        return held, None

    del torch
    return step, report


def run_runner(name: str, model: str, directory: str, out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = llama_config(model)
    if name == "ds3":
        os.environ["DS_ACCELERATOR"] = "cpu"
        step, report = _deepspeed(cfg, world)
    else:
        zero = {"stage3_prefetch_bucket_size": 1} if name == "z3-p1" else {}
        step, report = _zero3d(cfg, 2 if name == "z2" else 3, directory, world, **zero)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=g) for _ in range(steps + 1)]
    step(batches[0])  # warm-up: gradient buffers, optimizer states, the recorded fetch order
    before = _kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    for ids in batches[1:]:
        step(ids)
    seconds = (time.perf_counter() - start) / steps
    peak = _kib("VmHWM")
    base, state = report()
    row = {"rank": rank, "base_bytes": base, "state_bytes": state, "peak_kib": peak, "before_kib": before,
           "step_s": seconds}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.runner:
        run_runner(args.runner, args.model, args.dir, args.out, args.steps)
        return
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        base = LlamaForCausalLM(cfg)
        whole = sum(p.numel() * p.element_size() for p in base.parameters())
        block = sum(p.numel() * p.element_size() for p in base.model.layers[0].parameters())
        base.save_pretrained(tmp)
        del base
        print(f"model {args.model}: base {whole / 2**20:.1f} MiB fp32, one block {block / 2**20:.1f} MiB; "
              f"rank-8 LoRA on {', '.join(TARGETS)}; {args.nproc} ranks, {args.steps} steps of {MICRO}x{SEQ} tokens")
        print("| runner | base bytes / rank (MiB) | base / whole | other state (MiB) | RSS before the steps (MiB) "
              "| peak RSS over the steps (MiB) | peak - before (MiB) | s/step |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.only.split(","):
            out = os.path.join(tmp, f"{name}.json")
            if not launch_runner(__file__, name, args.nproc, ["--model", args.model, "--dir", tmp, "--out", out,
                                                               "--steps", str(args.steps)], args.timeout):
                continue
            with open(out) as f:
                rows = json.load(f)
            base_b = max(r["base_bytes"] for r in rows)
            state = max((r["state_bytes"] or 0) for r in rows)
            peak = max(r["peak_kib"] for r in rows) / 1024
            before = max(r["before_kib"] for r in rows) / 1024
            added = max(r["peak_kib"] - r["before_kib"] for r in rows) / 1024
            sec = max(r["step_s"] for r in rows)
            state_text = f"{state / 2**20:.2f}" if rows[0]["state_bytes"] is not None else "n/a"
            print(f"| {name} | {base_b / 2**20:.1f} | {base_b / whole:.3f} | {state_text} | {before:.0f} | {peak:.0f} "
                  f"| {added:.0f} | {sec:.2f} |", flush=True)
        print(f"two blocks gathered: {2 * block / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
