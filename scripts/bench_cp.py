"""Context parallelism (Ulysses) on CPU: activation memory and step time per rank at cp 1, 2 and 4.

    torchrun --nproc-per-node 4 scripts/bench_cp.py [--seq 2048 --hidden 256 --layers 2 --heads 8]
                                                    [--steps 3 --warmup 1]

One job of four ranks, one random-init Llama (same weights on every rank), one sequence length,
three layouts built in the same processes and stepped in turn (so a shared machine's load falls
on all of them alike):

* ``cp1``  dp 4: every rank runs a whole sequence (the memory one rank needs without cp);
* ``cp2``  dp 2 x cp 2: each rank holds half of a sequence's tokens;
* ``cp4``  cp 4: each rank holds a quarter.

Per rank it reports the bytes autograd keeps for backward over one forward (each saved
storage counted once, parameters left out: the activations that bound the longest trainable
sequence) and the median step time, and their ratios to cp1. ZeRO stage 0, fp32, sdpa attention.

Then, with ``--deepspeed``, forward + backward alone (no optimizer) at cp 4 on the same cut
batch: Zero3D's Ulysses attention against DeepSpeed's ``UlyssesSPAttentionHF``
(``register_with_transformers``, which replaces transformers' "sdpa" function in the whole
process, so it runs after everything else).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LAYOUTS = {"cp1": 1, "cp2": 2, "cp4": 4}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per layout first")
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeed's Ulysses at cp 4")
    return ap.parse_args(argv)


def make_model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, attn_implementation="sdpa"))


@contextlib.contextmanager
def saved_bytes(counter: dict, params: set[int]):
    """Count the bytes of the storages autograd saves for backward (each once; parameters left out)."""
    seen: set[int] = set(params)

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counter["bytes"] = counter.get("bytes", 0) + storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


class Layout:
    def __init__(self, name: str, cp: int, args, tokens: torch.Tensor) -> None:
        import parallel3d

        world = dist.get_world_size()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "context_parallel": {"size": cp}, "zero_optimization": {"stage": 0}, "steps_per_print": 10**6,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        self.name, self.cp = name, cp
        self.engine, _, _, _ = parallel3d.initialize(model=make_model(args), config=config)
        row = self.engine.mesh.local_rank("dp")
        self.batch = {"input_ids": tokens[row:row + 1], "labels": tokens[row:row + 1]}
        assert self.engine.mesh.dp == world // cp
        self.times: list[float] = []
        self.saved = 0

    def step(self, timed: bool) -> None:
        counter: dict = {}
        dist.barrier()
        start = time.perf_counter()
        params = {p.untyped_storage().data_ptr() for p in self.engine.module.parameters()}
        with saved_bytes(counter, params):
            loss = self.engine(**self.batch).loss
        self.engine.backward(loss)
        self.engine.step()
        dist.barrier()
        if timed:
            self.times.append(time.perf_counter() - start)
        self.saved = counter["bytes"]


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != 4:
        raise SystemExit("run with torchrun --nproc-per-node 4")
    tokens = torch.randint(0, args.vocab, (world, args.seq), generator=torch.Generator().manual_seed(1))
    layouts = [Layout(name, cp, args, tokens) for name, cp in LAYOUTS.items()]
    for round_ in range(args.warmup + args.steps):
        for layout in layouts if round_ % 2 == 0 else layouts[::-1]:
            layout.step(timed=round_ >= args.warmup)
    rows = []
    for layout in layouts:
        saved = torch.tensor([float(layout.saved)])
        dist.all_reduce(saved, op=dist.ReduceOp.MAX)
        rows.append((layout.name, saved.item(), statistics.median(layout.times)))
    if rank == 0:
        base_saved, base_time = rows[0][1], rows[0][2]
        print(f"seq {args.seq}, hidden {args.hidden}, layers {args.layers}, heads {args.heads}, 4 ranks (gloo, CPU, "
              "1 thread each)")
        print(f"{'layout':8}{'saved MiB/rank':>16}{'ratio':>8}{'step s':>10}{'ratio':>8}")
        for name, saved, step in rows:
            print(f"{name:8}{saved / 2**20:16.1f}{saved / base_saved:8.2f}{step:10.3f}{step / base_time:8.2f}")
    if args.deepspeed:
        versus_deepspeed(args, tokens)
    dist.destroy_process_group()


def forward_backward(forward) -> float:
    dist.barrier()
    start = time.perf_counter()
    forward().loss.backward()
    dist.barrier()
    return time.perf_counter() - start


def versus_deepspeed(args, tokens: torch.Tensor) -> None:
    """Forward + backward at cp 4: Zero3D's Ulysses attention and DeepSpeed's, on the same cut batch."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from parallel3d.config import load_config
    from parallel3d.context_parallel import apply_context_parallel
    from parallel3d.mesh import build_mesh

    world = dist.get_world_size()
    config = load_config({"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": world}}, world)
    ours = make_model(args)
    split = apply_context_parallel(ours, config, build_mesh(1, 1, torch.device("cpu"), cp=world))
    theirs = make_model(args)
    deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm over the process group already made
    UlyssesSPAttentionHF.register_with_transformers(theirs, "sdpa", sequence_parallel_size=world, micro_batch_size=1,
                                                    seq_length=args.seq, seq_length_is_variable=False)
    whole = {"input_ids": tokens[:1], "labels": tokens[:1]}
    cut = split.cut(whole)
    times: dict[str, list[float]] = {"zero3d": [], "deepspeed": []}
    losses = {}
    for round_ in range(args.warmup + args.steps):
        for name in (["zero3d", "deepspeed"] if round_ % 2 == 0 else ["deepspeed", "zero3d"]):
            elapsed = forward_backward((lambda: split.run(ours, whole)) if name == "zero3d" else (lambda: theirs(**cut)))
            if round_ >= args.warmup:
                times[name].append(elapsed)
    for name, model in (("zero3d", ours), ("deepspeed", theirs)):
        with torch.no_grad():
            loss = (split.run(model, whole) if name == "zero3d" else model(**cut)).loss
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses[name] = loss.item()
    if dist.get_rank() == 0:
        ours_s, theirs_s = statistics.median(times["zero3d"]), statistics.median(times["deepspeed"])
        print(f"forward+backward at cp {world}: zero3d {ours_s:.3f} s, deepspeed UlyssesSPAttentionHF {theirs_s:.3f} s, "
              f"ratio {ours_s / theirs_s:.2f}; loss {losses['zero3d']:.6f} vs {losses['deepspeed']:.6f}")


if __name__ == "__main__":
    main()
