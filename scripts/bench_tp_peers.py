"""Tensor parallelism against its peers: Zero3D TP, PyTorch DTensor TP and DeepSpeed AutoTP.

    python scripts/bench_tp_peers.py [--model A|H] [--rounds 2] [--steps N] [--memory]
                                     [--only ztp,ztp-sp,dtp,dtp-sp,dsautotp]

tp 2 on two gloo ranks (``--nproc``), dp 1, the same seeded Llama (``bench_runners.MODELS``;
H is model A at hidden 1024) and the same token batches on both ranks, fp32 AdamW with
clipping 1.0, each runner with its own optimizer step:

* ``ztp`` / ``ztp-sp``  Zero3D, ``tensor_parallel.size`` 2, without / with sequence parallel:
  Megatron layers on every projection, vocab-parallel embedding, head and cross entropy.
* ``dtp`` / ``dtp-sp``  PyTorch DTensor: ``parallelize_module`` with the Colwise/Rowwise
  styles HF's ``base_model_tp_plan`` names for each block, the embedding ``RowwiseParallel``
  (vocab-split), the head ``ColwiseParallel`` with its logits left vocab-split and the loss
  under ``loss_parallel()`` (torchtitan's plan); ``-sp`` adds ``SequenceParallel`` on the
  norms and ``PrepareModuleInput`` where blocks enter attention and MLP.
* ``dsautotp``  DeepSpeed AutoTP training (``tensor_parallel.autotp_size`` 2, ZeRO 0).

The driver (``bench_zero.launch``) runs all runners in one ``torchrun`` job per round,
interleaved step by step (as ``bench_zero.py --interleave``); after the timed steps every
runner takes one more step with its collectives counted (``comm_counter`` with
``functional=True``, so DTensor's are seen too). ``--memory`` adds one job per runner alone
for its peak RSS. Ratios are Zero3D over each peer (lower is better).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_runners import RUNNERS, TP, deepspeed_engine, ds_config, engine_step, model_spec  # noqa: E402

NAMES = ["ztp", "ztp-sp", "dtp", "dtp-sp", "dsautotp"]
LABEL = {"ztp": "Zero3D TP", "ztp-sp": "Zero3D TP+SP", "dtp": "DTensor TP", "dtp-sp": "DTensor TP+SP",
         "dsautotp": "DeepSpeed AutoTP"}


def dtensor_plan(model, sp: bool) -> tuple[dict, dict, object]:
    """(block plan, base-model plan, head style) for ``parallelize_module``: HF's ``base_model_tp_plan`` for the
    blocks' projections; embedding and head split over the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    block = {}
    for pattern, style in model.config.base_model_tp_plan.items():
        if not pattern.startswith("layers.*."):
            raise SystemExit(f"unexpected tp plan entry {pattern}")
        kw = {"output_layouts": Shard(1)} if sp and style == "rowwise" else {}
        block[pattern[len("layers.*."):]] = styles[style](**kw)
    seq = Shard(1) if sp else Replicate()
    root = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": SequenceParallel() if sp else None}
    head = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if sp:
        block.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                      "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                      desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                      use_local_output=True),
                      "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                use_local_output=True)})
    return block, {k: v for k, v in root.items() if v is not None}, head


def setup_dtensor_tp(model, spec, stage, sp=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.nn.utils import get_total_norm

    from bench_runners import ADAMW, CLIP

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    block, root, head = dtensor_plan(model, sp)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, block)
    parallelize_module(model.model, mesh, root)
    parallelize_module(model.lm_head, mesh, head)
    # Without sequence parallel the norms stay plain tensors; torch's foreach kernels (clipping,
    # AdamW) refuse lists mixing them with DTensors, so each kind is its own list / param group.
    kinds = [[p for p in model.parameters() if isinstance(p, DTensor) == d] for d in (True, False)]
    kinds = [k for k in kinds if k]
    opt = torch.optim.AdamW([{"params": k} for k in kinds], **ADAMW)

    def step(ids):
        # with sequence parallel the blocks see a sequence shard: the rotary table must still
        # cover the whole sequence, so the positions are given (HF would count the shard's)
        pos = torch.arange(ids.shape[1]).expand_as(ids) if sp else None
        with loss_parallel():
            model(input_ids=ids, labels=ids, position_ids=pos).loss.backward()
        norms = [get_total_norm([p.grad for p in k]) for k in kinds]
        total = sum(float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2 for n in norms) ** 0.5
        for k in kinds:
            torch._foreach_mul_([p.grad for p in k], min(1.0, CLIP / (total + 1e-6)))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def setup_autotp(model, spec, stage):
    config = ds_config(spec, 0)
    config["tensor_parallel"] = {"autotp_size": TP}
    return engine_step(deepspeed_engine(model, spec, 0, config)), lambda: None


RUNNERS.update({"dtp": (setup_dtensor_tp, 0), "dtp-sp": (functools.partial(setup_dtensor_tp, sp=True), 0),
                "dsautotp": (setup_autotp, 0)})


# -- driver --------------------------------------------------------------------------------


def _model_name(name: str) -> str:
    try:
        model_spec(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name


def parse_args(argv=None, names=NAMES, doc=__doc__):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="A", type=_model_name,
                    help="A (13.7M params), H (A at hidden 1024), T (tiny, for tests), B (134M), L (254M); "
                         "NAME@SEQ sets the sequence length (A@512)")
    ap.add_argument("--steps", type=int, help="timed steps per run (default: model's)")
    ap.add_argument("--warmup", type=int, help="untimed steps before them (default: model's)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved jobs (runner order reversed every other)")
    ap.add_argument("--memory", action="store_true", help="also run each runner alone once, for its peak RSS")
    ap.add_argument("--only", default=",".join(names), help="comma-separated, of: " + ",".join(names))
    ap.add_argument("--nproc", type=int, default=TP)
    ap.add_argument("--json", help="also write every run's raw result (one JSON line each) here")
    ap.add_argument("--timeout", type=int, default=900, help="seconds before a job is killed")
    ap.add_argument("--runner", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def drive(args, names: list[str], labels: dict, script: str, pairs: dict[str, list[str]]) -> dict:
    """Run ``names`` interleaved for ``args.rounds`` jobs (and alone with ``--memory``); print
    the table and the ratio of each Zero3D runner (``pairs`` key) over each of its peers; return the stats."""
    from bench_zero import collect, launch

    tmp = tempfile.mkdtemp(prefix="bench_peers_")
    inter, alone = os.path.join(tmp, "interleaved.jsonl"), os.path.join(tmp, "alone.jsonl")
    print(f"model {args.model}, {args.nproc} ranks, {args.rounds} interleaved rounds, logs in {tmp}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    failed = []
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        if not launch(",".join(order), args, args.nproc, inter, os.path.join(tmp, f"round{rnd}.log"), script):
            failed.append(f"round {rnd}")
    if args.memory:
        for name in names:
            if not launch(name, args, args.nproc, alone, os.path.join(tmp, f"{name}.alone.log"), script):
                failed.append(name)
    read = lambda p: [json.loads(x) for x in open(p)] if os.path.exists(p) else []  # noqa: E731
    results, mem_results = read(inter), read(alone)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results + mem_results)
    if not results:
        raise SystemExit(f"no interleaved run finished ({failed})")
    stats, mem = collect(results, names), collect(mem_results, names)
    comm = {r["runner"]: r["comm"] for r in results if r.get("comm")}
    r0 = results[0]
    print(f"\nmodel {args.model}: Llama {r0['params'] / 1e6:.1f}M params, batch {r0['spec']['micro']} x "
          f"{r0['spec']['seq']} (the same on every rank), {r0['world']} ranks, {len(r0['step_s'])} timed steps x "
          f"{args.rounds} rounds interleaved; load average {os.getloadavg()[0]:.2f} at end; torch {r0['torch']}")
    fmt = "{:<18} {:>9} {:>15} {:>8} {:>9} {:>10} {:>7} {:>10} {:>10}"
    print(fmt.format("runner", "median s", "round medians", "cpu s", "peak MiB", "train MiB", "calls",
                     "MiB moved", "wire MiB"))
    for name, s in stats.items():
        m, c = mem.get(name, {}), comm.get(name, {})
        cell = lambda v, f="{:.0f}": f.format(v) if v is not None else "-"  # noqa: E731
        print(fmt.format(labels[name], f"{s['median_s']:.3f}", " ".join(f"{x:.3f}" for x in s["round_medians"]),
                         f"{s['cpu_s']:.3f}", cell(m.get("peak_mib")), cell(m.get("train_peak_mib")),
                         cell(c.get("calls")), cell(c.get("nbytes", 0) / 2**20 if c else None, "{:.1f}"),
                         cell(c.get("wire_bytes", 0) / 2**20 if c else None, "{:.1f}")))
    print("\nratios (Zero3D / peer; step = pooled median wall, lower is better):")
    for z in [b for b in pairs if b in stats]:
        for peer in [n for n in pairs[z] if n in stats]:
            line = f"  {labels[z]:<18} / {labels[peer]:<22} step {stats[z]['median_s'] / stats[peer]['median_s']:.3f}"
            paired = [a / b for a, b in zip(stats[z]["round_medians"], stats[peer]["round_medians"])]
            line += "  per round " + " ".join(f"{x:.3f}" for x in paired)
            if z in mem and peer in mem and mem[peer]["peak_mib"]:
                line += f"  peak RSS {mem[z]['peak_mib'] / mem[peer]['peak_mib']:.3f}"
            if comm.get(z) and comm.get(peer) and comm[peer]["wire_bytes"]:
                line += f"  wire bytes {comm[z]['wire_bytes'] / comm[peer]['wire_bytes']:.3f}"
            print(line)
    for name in stats:
        if comm.get(name):
            print(f"  {labels[name]} collectives of one step (rank 0; group/op: calls, MiB): " + ", ".join(
                f"{k} {v[0]} {v[1] / 2**20:.1f}" for k, v in comm[name]["by_op"].items()))
    if failed:
        print(f"FAILED: {failed} (see the logs in {tmp})")
    return {"stats": stats, "memory": mem, "comm": comm, "failed": failed}


def run_job(args, count_comm: bool) -> None:
    """Inside a job (every rank): run ``args.runner`` (comma-separated) on the same data on all ranks."""
    from bench_runners import run

    spec = model_spec(args.model)
    run(args.runner.split(","), args.model, args.steps or spec.steps,
        spec.warmup if args.warmup is None else args.warmup, args.out, same_data=True, count_comm=count_comm)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.runner:
        return run_job(args, count_comm=True)
    names = [n for n in args.only.split(",") if n]
    if set(names) - set(NAMES):
        raise SystemExit(f"unknown runners {sorted(set(names) - set(NAMES))}; choose from {NAMES}")
    peers = ["dtp", "dtp-sp", "dsautotp"]
    return drive(args, names, LABEL, __file__, {"ztp": peers, "ztp-sp": peers})


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
