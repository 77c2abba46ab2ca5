"""Context parallelism (Ulysses and ring) on CPU: memory, longest sequence and step time per rank.

    torchrun --nproc-per-node 4 scripts/bench_cp.py [--seq 2048 --hidden 256 --layers 2 --heads 8]
                                                    [--steps 3 --warmup 1] [--longest] [--deepspeed]

One job of four ranks, one random-init Llama (same weights on every rank), one sequence length,
three layouts built in the same processes and stepped in turn (so a shared machine's load falls
on all of them alike):

* ``cp1``  dp 4: every rank runs a whole sequence (the memory one rank needs without cp);
* ``cp2``  dp 2 x cp 2 (Ulysses): each rank holds half of a sequence's tokens;
* ``cp4``  cp 4 (Ulysses): each rank holds a quarter;
* ``ring2``, ``ring4``: the same with ring attention.

Per rank it reports the bytes autograd keeps for backward over one forward (each saved
storage counted once, parameters left out: the activations that bound the longest trainable
sequence) and the median step time, and their ratios to cp1. ZeRO stage 0, fp32, sdpa attention.

With ``--longest``, the longest sequence each layout trains within a fixed peak-memory budget
per rank: the budget is cp1's peak at ``--seq`` tokens, the peak measured over one whole step
(forward, backward, optimizer step) with torch's ``MemTracker`` (every live tensor: parameters,
gradients, optimizer states, activations, transients such as attention scores and the ring's
k/v buffers), on the rank with the highest peak; lengths are searched in steps of ``--granule``.

Then, with ``--deepspeed``, forward + backward alone (no optimizer) at cp 4 on the same batch:
Zero3D's Ulysses and ring attention against DeepSpeed's ``UlyssesSPAttentionHF``
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

LAYOUTS = {"cp1": (1, "ulysses"), "cp2": (2, "ulysses"), "cp4": (4, "ulysses"), "ring2": (2, "ring"),
           "ring4": (4, "ring")}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per layout first")
    ap.add_argument("--longest", action="store_true", help="longest sequence per layout at cp1's peak at --seq")
    ap.add_argument("--granule", type=int, default=256, help="length step of the --longest search")
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


def held_tensors(root, depth: int = 4) -> list[torch.Tensor]:
    """Tensors an object keeps (attributes, lists, dicts, a few levels deep): the ZeRO optimizer's
    master weights, gradient buffers and states, which live across steps."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj, level: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
            return
        if level == 0 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, torch.nn.Module)):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            items = list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("zero", "parallel3d", "torch"):
            items = list(vars(obj).values())
        else:
            return
        for item in items:
            walk(item, level - 1)

    walk(root, depth)
    return list(found.values())


class Layout:
    def __init__(self, name: str, cp: int, method: str, args) -> None:
        import parallel3d

        world = dist.get_world_size()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "context_parallel": {"size": cp, "method": method}, "zero_optimization": {"stage": 0},
                  "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        self.name, self.cp = name, cp
        self.engine, _, _, _ = parallel3d.initialize(model=make_model(args), config=config)
        assert self.engine.mesh.dp == world // cp
        self.times: list[float] = []
        self.saved = 0

    def batch(self, tokens: torch.Tensor) -> dict:
        row = self.engine.mesh.local_rank("dp")
        return {"input_ids": tokens[row:row + 1], "labels": tokens[row:row + 1]}

    def step(self, tokens: torch.Tensor, timed: bool) -> None:
        counter: dict = {}
        dist.barrier()
        start = time.perf_counter()
        params = {p.untyped_storage().data_ptr() for p in self.engine.module.parameters()}
        with saved_bytes(counter, params):
            loss = self.engine(**self.batch(tokens)).loss
        self.engine.backward(loss)
        self.engine.step()
        dist.barrier()
        if timed:
            self.times.append(time.perf_counter() - start)
        self.saved = counter["bytes"]

    def peak(self, tokens: torch.Tensor) -> float:
        """Peak bytes over one step on the rank that peaks highest (see the module docstring)."""
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(self.engine.module, *held_tensors(self.engine.optimizer))
        dist.barrier()
        with tracker:
            self.engine.backward(self.engine(**self.batch(tokens)).loss)
            self.engine.step()
        peak = torch.tensor([float(max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()))])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak.item()


def random_tokens(args, length: int) -> torch.Tensor:
    return torch.randint(0, args.vocab, (dist.get_world_size(), length), generator=torch.Generator().manual_seed(1))


def longest(layout: Layout, args, budget: float) -> tuple[int, float]:
    """The longest multiple of the granule (and of 2 x cp) whose step peaks within ``budget``.

    Peak memory grows about linearly with the length: two measurements give the estimate, then
    the search walks a granule at a time from it until the next length would not fit."""
    granule = args.granule
    low, high = args.seq // 2, args.seq
    low_peak, high_peak = layout.peak(random_tokens(args, low)), layout.peak(random_tokens(args, high))
    slope = (high_peak - low_peak) / (high - low)
    length = max(granule, int((high + (budget - high_peak) / slope) // granule * granule))
    peak = layout.peak(random_tokens(args, length))
    while peak > budget and length > granule:
        length -= granule
        peak = layout.peak(random_tokens(args, length))
    while True:
        bigger = layout.peak(random_tokens(args, length + granule))
        if bigger > budget:
            return length, peak
        length, peak = length + granule, bigger


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != 4:
        raise SystemExit("run with torchrun --nproc-per-node 4")
    tokens = random_tokens(args, args.seq)
    layouts = [Layout(name, cp, method, args) for name, (cp, method) in LAYOUTS.items()]
    for round_ in range(args.warmup + args.steps):
        for layout in layouts if round_ % 2 == 0 else layouts[::-1]:
            layout.step(tokens, timed=round_ >= args.warmup)
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
    if args.longest:
        budget = layouts[0].peak(tokens)
        found = [(layout.name, *longest(layout, args, budget)) for layout in layouts[1:]]
        if rank == 0:
            print(f"budget: cp1's peak at {args.seq} tokens, {budget / 2**20:.1f} MiB/rank (MemTracker, one step)")
            print(f"{'layout':8}{'longest':>9}{'x cp1':>7}{'peak MiB':>10}")
            for name, length, peak in found:
                print(f"{name:8}{length:9d}{length / args.seq:7.2f}{peak / 2**20:10.1f}")
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
    """Forward + backward at cp 4: Zero3D's Ulysses and ring attention and DeepSpeed's Ulysses, on
    the same batch (DeepSpeed's on Zero3D's Ulysses cut: contiguous slices, shifted labels)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from parallel3d.config.config import load_config
    from parallel3d.context_parallel import apply_context_parallel
    from parallel3d.runtime.mesh import build_mesh

    world = dist.get_world_size()
    whole = {"input_ids": tokens[:1], "labels": tokens[:1]}
    runners = {}
    cut = None
    for method in ("ulysses", "ring"):
        config = load_config({"train_micro_batch_size_per_gpu": 1,
                              "context_parallel": {"size": world, "method": method}}, world)
        model = make_model(args)
        split = apply_context_parallel(model, config, build_mesh(1, 1, torch.device("cpu"), cp=world))
        runners[f"zero3d {method}"] = lambda split=split, model=model: split.run(model, whole)
        cut = split.cut(whole) if method == "ulysses" else cut
    theirs = make_model(args)
    deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm over the process group already made
    UlyssesSPAttentionHF.register_with_transformers(theirs, "sdpa", sequence_parallel_size=world, micro_batch_size=1,
                                                    seq_length=args.seq, seq_length_is_variable=False)
    runners["deepspeed"] = lambda: theirs(**cut)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_ in range(args.warmup + args.steps):
        for name in list(runners) if round_ % 2 == 0 else list(runners)[::-1]:
            elapsed = forward_backward(runners[name])
            if round_ >= args.warmup:
                times[name].append(elapsed)
    losses = {}
    for name, run in runners.items():
        with torch.no_grad():
            loss = run().loss
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses[name] = loss.item()
    if dist.get_rank() == 0:
        base = statistics.median(times["deepspeed"])
        print(f"forward+backward at cp {world}, {args.seq} tokens (ratio to DeepSpeed UlyssesSPAttentionHF):")
        for name in runners:
            took = statistics.median(times[name])
            print(f"  {name:15}{took:8.3f} s{took / base:7.2f}   loss {losses[name]:.6f}")


if __name__ == "__main__":
    main()
