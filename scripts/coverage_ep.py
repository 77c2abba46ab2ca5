"""Expert parallelism over every causal-LM type whose config declares ``base_model_ep_plan``.

    python scripts/coverage_ep.py [--types mixtral,qwen3_moe] [--out docs/coverage_ep.jsonl]

Runs itself under ``torchrun`` on two CPU ranks. For each type, every rank builds the type's tiny
model (``scripts/coverage_check.tiny_model``, HF's per-expert loop, float64) and computes, as one
process, the loss, router loss and gradients of both ranks' batches; then it splits the experts
over the two ranks (``parallel3d.expert_parallel.apply_expert_parallel``: the plan, the slicing,
the all-to-all) and runs its own batch. Outcomes:

* ``pass``: the loss and router loss agree with one process to 1e-9 relative, and every gradient
  (a dense parameter's with its own batch's, a local expert's with the sum over both ranks'
  batches: the all-to-all brings every rank's tokens to it) to 1e-6 norm-wise (``GRAD_RTOL``);
* ``refused: <reason>``: a ConfigError of the plan reader (no MoE layer in the tiny config, a
  weight not stacked over the experts, an expert count that does not divide by 2, ...);
* ``fail: <what>``: a mismatch or an error (a bug, or a family the convention does not fit);
* ``skip: <why>``: the tiny model does not build or run in transformers itself.

The table for the README: ``python scripts/coverage_ep.py --table docs/coverage_ep.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

EP, SEQ, MICRO, VOCAB_LOW = 2, 8, 2, 3
RTOL, ATOL = 1e-9, 1e-12
GRAD_RTOL = 1e-6
"""Gradients, norm-wise: routers compute their softmax in float32 even in a float64 model
(``router_logits.float()``), so the routing weights' gradient is rounded to float32 there, and two
summation orders of the same float64 sums can round to neighbouring float32 values (a few 1e-8)."""


def ep_types() -> list[str]:
    """Model types with a causal LM whose (text) config declares a non-empty ``base_model_ep_plan``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = CONFIG_MAPPING[model_type]()
            plan = getattr(config.get_text_config(), "base_model_ep_plan", None)
        except Exception:  # noqa: BLE001 - a config that does not build is not listed
            continue
        if isinstance(plan, dict) and plan:
            out.append(model_type)
    return out


def _batches(vocab: int) -> list:
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(VOCAB_LOW, vocab, (MICRO, SEQ), generator=g) for _ in range(EP)]


def _run(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    aux = getattr(out, "aux_loss", None)
    return out.loss.item(), (aux.item() if aux is not None else None), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check(model_type: str, group, shard_group) -> str:
    """One type's outcome on this rank (module docstring)."""
    import torch
    import torch.distributed as dist

    from coverage_check import tiny_model
    from parallel3d.errors import ConfigError
    from parallel3d.expert_parallel import apply_expert_parallel

    try:
        start = tiny_model(model_type, experts_implementation="eager").double()
        batches = _batches(min(start.config.get_text_config().vocab_size, 96))
        want = [_run(copy.deepcopy(start), ids) for ids in batches]
    except Exception as exc:  # noqa: BLE001
        return f"skip: tiny model fails in transformers ({type(exc).__name__}: {str(exc)[:200]})"
    rank = dist.get_rank(group)
    model = copy.deepcopy(start)
    try:
        info = apply_expert_parallel(model, EP, group, shard_group)
    except ConfigError as exc:
        return f"refused: {exc}"
    try:
        loss, aux, grads = _run(model, batches[rank])
    except ConfigError as exc:
        return f"refused: {exc}"
    except Exception as exc:  # noqa: BLE001
        return f"fail: {type(exc).__name__}: {str(exc)[:300]}"
    if abs(loss - want[rank][0]) > RTOL * abs(want[rank][0]):
        return f"fail: loss {loss} != {want[rank][0]}"
    if aux is not None and abs(aux - want[rank][1]) > RTOL * abs(want[rank][1]) + ATOL:
        return f"fail: router loss {aux} != {want[rank][1]}"
    for name, grad in grads.items():
        if name in info.params:
            local = grad.shape[0]
            expected = sum(w[2][name] for w in want if name in w[2])[rank * local : (rank + 1) * local]
        else:
            expected = want[rank][2].get(name, torch.zeros_like(grad))
        err = (grad - expected).norm().item() / max(expected.norm().item(), 1e-30)
        if err > GRAD_RTOL:
            return f"fail: gradient of {name} differs by {err:.2e} (relative, norm-wise)"
    return "pass"


def worker(types: list[str], out: str) -> None:
    import torch.distributed as dist

    from parallel3d.runtime.mesh import build_mesh

    import transformers

    from tests.float64_loss import install

    install()  # the token loss in float64 for float64 logits (transformers casts them to float32)
    transformers.logging.set_verbosity_error()
    mesh = build_mesh(1, 1, ep=EP)
    for model_type in types:
        t = time.perf_counter()
        outcome = check(model_type, mesh.groups.ep, mesh.groups.expert_shard)
        outcomes = [None] * EP
        dist.all_gather_object(outcomes, outcome)
        if dist.get_rank() == 0:
            worst = next((o for o in outcomes if not o.startswith("pass")), outcomes[0])
            with open(out, "a") as f:
                f.write(json.dumps({"type": model_type, "ep2": worst, "seconds": round(time.perf_counter() - t, 1)})
                        + "\n")
            print(model_type, worst[:120], flush=True)


def table(path: str) -> str:
    """The README's markdown table of a results file, refusal reasons as numbered notes."""
    rows = [json.loads(line) for line in open(path)]
    notes: list[str] = []
    lines = ["| model type | ep 2 |", "|---|---|"]
    for row in rows:
        outcome = row["ep2"]
        kind, _, why = outcome.partition(": ")
        if why:
            if why not in notes:
                notes.append(why)
            outcome = f"{kind} [{notes.index(why) + 1}]"
        lines.append(f"| `{row['type']}` | {outcome} |")
    counts = {k: sum(r["ep2"].startswith(k) for r in rows) for k in ("pass", "refused", "fail", "skip")}
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    return "\n".join([f"{len(rows)} types: {summary}.", "", *lines, "", *(f"{i}. {n}" for i, n in enumerate(notes, 1))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", help="comma-separated model types (default: every type with base_model_ep_plan)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "coverage_ep.jsonl"))
    ap.add_argument("--table", help="print the markdown table of this results file and stop")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    types = args.types.split(",") if args.types else ep_types()
    if args.worker:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        worker(types, args.out)
        dist.destroy_process_group()
        return
    if os.path.exists(args.out):
        os.remove(args.out)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={EP}", __file__,
           "--worker", "--out", args.out, "--types", ",".join(types)]
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    print(table(args.out))


if __name__ == "__main__":
    main()
