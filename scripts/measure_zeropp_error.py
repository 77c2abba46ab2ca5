"""The error of ZeRO++'s int8 collectives (zero/quantized_comm.py) in training, on CPU ranks.

    torchrun --nproc-per-node 2 scripts/measure_zeropp_error.py [--steps 200] [--every 20] [--model A]

Trains a benchmark model (A by default) at ZeRO-3 twice from the same start on the same data
(``--distinct`` micro-batches per rank, cycled, so the loss falls), once with
full-precision collectives and once with ``zero_quantized_weights`` and
``zero_quantized_gradients``, and prints

* every ``--every`` steps: the relative error of a quantized gather of the current weights
  (``||deq(q(w)) - w|| / ||w||`` over every stage-3 shard) and of a quantized reduction of the
  ranks' gradients of one micro-batch each (``||qgZ(g) - mean(g)|| / ||mean(g)||``, on a plain
  copy of the model at the full-precision run's weights);
* both loss curves (mean over windows of ``--every`` steps) and their largest relative gap.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_runners import build_model, ds_config, model_spec, token_batches  # noqa: E402
from zero.quantized_comm import dequantize, quantize, reduce_to_shard_int8  # noqa: E402


def _engine(spec, quantized: bool):
    import parallel3d

    config = ds_config(spec, 3)
    # every tensor sharded, so that every weight a forward uses went through the (quantized) gather
    config["zero_optimization"].update(zero_quantized_weights=quantized, zero_quantized_gradients=quantized,
                                       stage3_param_persistence_threshold=0)
    torch.manual_seed(0)
    return parallel3d.initialize(model=build_model(spec), config=config)[0]


def _weight_error(engine) -> float:
    squares = torch.zeros(2, dtype=torch.float64)
    for unit in engine.optimizer.units:
        shard = unit.shard.detach().float()
        squares[0] += (dequantize(*quantize(shard)) - shard).double().pow(2).sum()
        squares[1] += shard.double().pow(2).sum()
    dist.all_reduce(squares)
    return (squares[0] / squares[1]).sqrt().item()


def _gradient_error(spec, weights: dict, ids: torch.Tensor) -> float:
    model = build_model(spec)
    model.load_state_dict(weights, strict=False)
    model(input_ids=ids, labels=ids).loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    world = dist.get_world_size()
    grad = torch.nn.functional.pad(grad, (0, -grad.numel() % world))
    exact = grad.clone()
    dist.all_reduce(exact, op=dist.ReduceOp.AVG)
    shard = torch.empty(grad.numel() // world)
    reduce_to_shard_int8(grad.clone(), shard, None, accumulate=False).wait()
    mine = exact.view(world, -1)[dist.get_rank()]
    squares = torch.stack([(shard - mine).double().pow(2).sum(), mine.double().pow(2).sum()])
    dist.all_reduce(squares)
    return (squares[0] / squares[1]).sqrt().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--model", default="A", help="a benchmark model of scripts/bench_runners.py (A, T, ...)")
    ap.add_argument("--distinct", type=int, default=8,
                    help="micro-batches cycled through, so that the loss falls as the model learns them")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = model_spec(args.model)
    distinct = token_batches(spec, dist.get_rank(), args.distinct)
    data = [distinct[i % args.distinct] for i in range(args.steps)]
    runs = {}
    errors = []
    for quantized in (False, True):
        engine = _engine(spec, quantized)
        losses = []
        for step, ids in enumerate(data):
            if quantized and step % args.every == 0:
                errors.append((step, _weight_error(engine)))
            if not quantized and step % args.every == 0:
                errors.append((step, _gradient_error(spec, engine.full_parameters(), ids)))
            engine.backward(loss := engine(input_ids=ids, labels=ids).loss)
            engine.step()
            losses.append(loss.item())
        runs[quantized] = torch.tensor(losses)
        del engine
    if dist.get_rank() == 0:
        grads = {s: e for s, e in errors[: len(errors) // 2]}
        weights = {s: e for s, e in errors[len(errors) // 2 :]}
        print("step  weights rel. error  gradients rel. error  loss fp32  loss int8")
        for start in range(0, args.steps, args.every):
            window = slice(start, start + args.every)
            print(f"{start:4d}  {weights[start]:18.2e}  {grads[start]:20.2e}  {runs[False][window].mean():9.4f}"
                  f"  {runs[True][window].mean():9.4f}")
        gap = ((runs[True] - runs[False]).abs() / runs[False]).max().item()
        print(f"largest relative gap between the loss curves over {args.steps} steps: {gap:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
