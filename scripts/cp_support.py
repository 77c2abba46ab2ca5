"""Which model types run under context parallelism (Ulysses or ring, cp 2) and equal one process.

    python scripts/cp_support.py [--method ulysses|ring] [--out docs/coverage_cp.jsonl] [types...]

Two gloo ranks on the CPU. For each causal-LM type transformers knows (or those named), the
coverage script's tiny model (``scripts/coverage_check.py`` ``tiny_model``, eager attention) in
float64 is checked by the function ``initialize`` calls before any collective; if accepted, one
forward and backward of a 16-token micro-batch through the cut and the Ulysses or ring attention
(both ranks; ring's results in ``docs/coverage_cp_ring.jsonl``), whose loss (mean over cp) and
gradients (summed over cp, divided by cp: each rank's loss is cp times its share) must equal one
process's: the loss to 1e-9, each gradient to 1e-5 norm-wise. One JSON line per type: "pass",
"refused: ..." (at start-up or by the run-time checks), "differs: ..." or "error: ...".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


SEQ, ROWS, RTOL = 16, 2, 1e-9
GRAD_RTOL = 1e-5  # some families normalize in float32 in a float64 model (Gemma's RMSNorm), summed in another order


def _batch(vocab: int) -> dict:
    ids = torch.randint(0, min(vocab, 100), (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def outcome(model_type: str, group, method: str = "ulysses") -> str:
    from coverage_check import tiny_model

    from parallel3d.context_parallel.batch import SequenceSplit
    from parallel3d.context_parallel.model import check_model, windowed_layers
    from parallel3d.context_parallel.ring import RingAttention
    from parallel3d.context_parallel.ulysses import UlyssesAttention
    from parallel3d.errors import ConfigError

    cp = dist.get_world_size(group)
    try:
        model, reference = tiny_model(model_type), tiny_model(model_type)
    except Exception as exc:  # a tiny config transformers cannot build is skipped, as in the coverage table
        return f"skip: tiny config fails in transformers ({type(exc).__name__})"
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):  # grouped_mm: no float64
        model, reference = (tiny_model(model_type, experts_implementation="eager") for _ in range(2))
    model, reference = model.double(), reference.double()
    try:
        check_model(model, cp, 1, method)
    except ConfigError as exc:
        return f"refused: {exc}"
    from transformers import AttentionInterface

    attention = (RingAttention(group, model_type) if method == "ring"
                 else UlyssesAttention(group, model.config._attn_implementation, model_type))
    name = f"cp_support_{model_type}"
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    model.train()
    reference.train()
    split = SequenceSplit(attention, dist.get_rank(group), False, model.config.get_text_config().num_hidden_layers,
                          windowed_layers(model))
    batch = _batch(model.config.get_text_config().vocab_size)
    try:
        loss = split.run(model, batch).loss
    except ConfigError as exc:
        return f"refused: {exc}"
    loss.backward()
    want = reference(**batch).loss
    want.backward()
    got = loss.detach().clone()
    dist.all_reduce(got, op=dist.ReduceOp.AVG, group=group)
    if not torch.allclose(got, want.detach(), rtol=RTOL, atol=0):
        return f"differs: loss {got.item():.12g} vs {want.item():.12g}"
    # a gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift of every score)
    # is rounding noise in both runs, so each is measured against the largest gradient too
    floor = 1e-10 * max(q.grad.norm().item() for q in reference.parameters() if q.grad is not None)
    worst, where = 0.0, ""
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            continue
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(q)
        dist.all_reduce(g, group=group)
        err = ((g / cp - q.grad).norm() / (q.grad.norm() + floor)).item()
        if err > worst:
            worst, where = err, n
    return "pass" if worst < GRAD_RTOL else f"differs: gradient of {where} by {worst:.1e}"


def worker(rank: int, port: int, types: list[str], out: str, method: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    import transformers

    from float64_loss import install

    install()
    transformers.logging.set_verbosity_error()
    for model_type in types:
        try:
            result = outcome(model_type, dist.group.WORLD, method)
        except Exception as exc:
            result = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        results = [None, None]
        dist.all_gather_object(results, result)
        if rank == 0:
            agreed = results[0] if results[0] == results[1] else f"ranks differ: {results}"
            with open(out, "a") as f:
                line = {"type": model_type, "cp": 2, "outcome": agreed}
                line |= {"method": method} if method != "ulysses" else {}
                f.write(json.dumps(line) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=("ulysses", "ring"), default="ulysses")
    ap.add_argument("--out", type=Path, help="default docs/coverage_cp.jsonl (ring: docs/coverage_cp_ring.jsonl)")
    ap.add_argument("types", nargs="*")
    args = ap.parse_args(argv)
    args.out = args.out or Path("docs/coverage_cp_ring.jsonl" if args.method == "ring" else "docs/coverage_cp.jsonl")
    from coverage import all_types, free_port

    done = set()
    if args.out.exists():
        done = {json.loads(line)["type"] for line in args.out.read_text().splitlines() if line.strip()}
    types = [t for t in (args.types or all_types()) if t not in done]
    mp.spawn(worker, args=(free_port(), types, str(args.out), args.method), nprocs=2)


if __name__ == "__main__":
    main()
