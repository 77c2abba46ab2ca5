"""Tensor parallelism on CPU: step time at tp = 2 against tp = 1, and the bytes each collective moves.

    torchrun --nproc-per-node 2 scripts/bench_tp.py [--hidden 512 --layers 4 --seq 256 --micro 4]
                                                    [--steps 6 --warmup 2] [--only tp2,tp2sp,dp2,single]

One job, one model (a random-init Llama; every rank builds the same weights from one seed),
one global batch of ``--micro`` sequences per step, four ways, all in the same processes:

* ``tp2``    tp = 2, dp = 1: both ranks run the whole batch on half of every layer.
* ``tp2sp``  the same with sequence parallelism (all-gather / reduce-scatter; on gloo each
             reduce-scatter is an all-reduce and a slice).
* ``dp2``    tp = 1, dp = 2 (ZeRO stage 0, i.e. DDP's all-reduce of the gradients): each rank
             runs half of the batch on the whole model.
* ``single`` tp = 1, dp = 1 on rank 0 alone with 2 intra-op threads (rank 1 waits): the same
             cores, no communication at all.

``tp2`` against ``dp2`` is the fair comparison: same two processes with one thread each, same
tokens per step, same update (both equal the single-process step), only the parallelism
differs. ``single`` tells what either buys over letting torch's threads share the cores.
Steps are taken in turn (runner order reversed every other round) so that the load of a
shared machine falls on all runners alike; the median step time is reported.

Then one more step of each runner is counted (``parallel3d.runtime.comm_counter``), split into
forward / backward / optimizer step, and printed beside the theory: per transformer layer,
forward 2 all-reduces of b*s*h (attention and MLP outputs), backward 2 more (their inputs'
gradients); besides the layers, the vocab-parallel embedding (forward, b*s*h), the head's
input gradient (backward, b*s*h), the vocab-parallel cross entropy (b*s and 2*b*s) and the
grad norm (1 element). See docs/benchmarks.md ("Tensor parallelism") for how to read it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RUNNERS = ["tp2", "tp2sp", "dp2", "single"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="sequences per step (the global batch)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per runner")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per runner first")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--single-threads", type=int, default=2, help="intra-op threads of the single runner")
    ap.add_argument("--only", default=",".join(RUNNERS), help="comma-separated, of: " + ",".join(RUNNERS))
    return ap.parse_args(argv)


def make_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.seq, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def config(args, tp: int, dp: int, sp: bool = False) -> dict:
    return {
        "train_batch_size": args.micro,
        "train_micro_batch_size_per_gpu": args.micro // dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"size": tp, "sequence_parallel": sp},
        "steps_per_print": 10**9,
    }


class Runner:
    """One way of taking a step; ``step()`` is a whole forward-backward-update of the global batch."""

    def __init__(self, name: str, args, tokens: torch.Tensor) -> None:
        import parallel3d

        self.name, self.mesh, self.psi = name, None, None
        rank = dist.get_rank()
        model = make_model(args)
        self.psi = sum(p.numel() for p in model.parameters())
        if name == "single":
            self.active, self.single_threads = rank == 0, args.single_threads
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
            self.batch = tokens
            return
        self.active = True
        tp, dp, sp = {"tp2": (2, 1, False), "tp2sp": (2, 1, True), "dp2": (1, 2, False)}[name]
        self.engine, _, _, _ = parallel3d.initialize(model=model, config=config(args, tp, dp, sp))
        self.mesh = self.engine.mesh
        if dp > 1:
            r = self.mesh.local_rank("dp")
            tokens = tokens.chunk(dp)[r]
        self.batch = tokens

    def step(self, comm=None, phases: dict | None = None) -> None:
        """One step; ``comm`` tags its collectives by phase, ``phases`` collects this rank's seconds per phase."""
        tag = comm.tag if comm is not None else (lambda _name: _nullcontext())
        clock = [time.perf_counter()]

        def lap(name: str) -> None:
            now = time.perf_counter()
            if phases is not None:
                phases.setdefault(name, []).append(now - clock[0])
            clock[0] = now

        if self.name == "single":
            if self.active:
                threads = torch.get_num_threads()
                torch.set_num_threads(self.single_threads)
                loss = self.model(input_ids=self.batch, labels=self.batch).loss
                lap("forward")
                loss.backward()
                lap("backward")
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.opt.step()
                self.opt.zero_grad()
                lap("step")
                torch.set_num_threads(threads)
            return
        with tag("forward"):
            loss = self.engine(input_ids=self.batch, labels=self.batch).loss
        lap("forward")
        with tag("backward"):
            self.engine.backward(loss)
        lap("backward")
        with tag("step"):
            self.engine.step()
        lap("step")


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def theory(name: str, args, L: int, psi: int) -> dict:
    """Expected calls per (phase, op, elements per call) for one step of ``name``."""
    b, s, h = args.micro, args.seq, args.hidden
    bsh, bs = b * s * h, b * s
    if name == "tp2":
        return {("forward", "all_reduce", bsh): (2 * L + 1, "2/layer + embedding"),
                ("forward", "all_reduce", bs): (1, "cross entropy: max"),
                ("forward", "all_reduce", 2 * bs): (1, "cross entropy: sum exp, target"),
                ("backward", "all_reduce", bsh): (2 * L + 1, "2/layer + head input grad"),
                ("step", "all_reduce", 1): (1, "grad norm (tp-split part)")}
    if name == "tp2sp":
        # gloo: each reduce-scatter of a layer is an all-reduce + slice (parallel3d/tensor_parallel/comm.py)
        return {("forward", "all_gather", bsh): (2 * L + 1, "2/layer + last block exit"),
                ("forward", "all_reduce", bsh): (2 * L + 1, "2/layer (reduce-scatter on gloo) + embedding"),
                ("forward", "all_reduce", bs): (1, "cross entropy: max"),
                ("forward", "all_reduce", 2 * bs): (1, "cross entropy: sum exp, target"),
                ("backward", "all_gather", bsh): (2 * L + 1, "2/layer + first block entry"),
                ("backward", "all_reduce", bsh): (2 * L + 1, "2/layer (reduce-scatter on gloo) + head input grad"),
                ("backward", "all_reduce", h): (2 * L, "2 norms/layer: partial grads"),
                ("step", "all_reduce", 1): (1, "grad norm (tp-split part)")}
    if name == "dp2":
        return {("backward", "all_reduce", psi): (1, "gradients (Psi, one bucket)")}
    return {}


def count_table(runner: Runner, args, L: int) -> tuple[list[str], dict]:
    from parallel3d.runtime.comm_counter import count_collectives

    with count_collectives(runner.mesh) as comm:
        runner.step(comm)
    b, s, h = args.micro, args.seq, args.hidden
    label = {b * s * h: "b*s*h", b * s: "b*s", 2 * b * s: "2*b*s", h: "h", runner.psi: "Psi", 1: "1"}
    rows: dict = {}
    for c in comm.calls:
        row = rows.setdefault((c.tag, c.group, c.op, c.numel), [0, 0, 0.0])
        row[0] += 1
        row[1] += c.nbytes
        row[2] += c.wire_bytes
    expect = theory(runner.name, args, L, runner.psi)
    lines = []
    for (tag, group, op, numel), (calls, nbytes, wire) in rows.items():
        want, why = expect.pop((tag, op, numel), (0, "(not predicted)"))
        size = f"{numel} ({label[numel]})" if numel in label else str(numel)
        ok = "ok" if want == calls else f"THEORY {want}"
        lines.append(f"{runner.name:<7} {tag:<9} {group:<5} {op:<15} {calls:>5} {size:>17} {nbytes / 2**20:>9.2f} "
                     f"{wire / 2**20:>9.2f}  {ok:<4} {why}")
    for (tag, op, numel), (want, why) in expect.items():
        lines.append(f"{runner.name:<7} {tag:<9} {'':<5} {op:<15} {0:>5} {numel:>17} {0:>9.2f} {0:>9.2f}  "
                     f"MISSING {want} {why}")
    totals = {"MiB": comm.total("nbytes") / 2**20, "wire MiB": comm.total("wire_bytes") / 2**20,
              "calls": comm.total("calls")}
    return lines, totals


def allreduce_ms(numel: int, reps: int = 10) -> float:
    """Median wall time of one gloo all-reduce of ``numel`` fp32 over the world (2 ranks)."""
    x = torch.ones(numel)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2")
    torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(RUNNERS)
    if unknown:
        raise SystemExit(f"unknown runners {sorted(unknown)}; choose from {RUNNERS}")
    if args.micro % 2 or args.seq % 2:
        raise SystemExit("--micro and --seq must be even (dp2 halves the batch, sequence parallel the sequence)")

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.micro, args.seq), generator=g)
    load0 = os.getloadavg()
    runners = [Runner(n, args, tokens) for n in names]
    psi = runners[0].psi
    L, b, s, h = args.layers, args.micro, args.seq, args.hidden
    say(f"Llama hidden {h}, {L} layers, {args.heads} heads, intermediate {args.intermediate}, vocab {args.vocab}: "
        f"Psi = {psi / 1e6:.1f}M params; batch {b} x seq {s} (b*s*h = {b * s * h} elements = "
        f"{b * s * h * 4 / 2**20:.1f} MiB fp32); {args.threads} thread(s) per rank; torch {torch.__version__}, gloo")

    for r in runners:
        for _ in range(args.warmup):
            r.step()
    times: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, dict] = {n: {} for n in names}
    for i in range(args.steps):
        order = runners if i % 2 == 0 else runners[::-1]
        for r in order:
            dist.barrier()
            t0 = time.perf_counter()
            r.step(phases=phases[r.name])
            dist.barrier()  # the step ends when the slower rank is done
            times[r.name].append(time.perf_counter() - t0)
    load1 = os.getloadavg()

    ar_ms = allreduce_ms(b * s * h)
    say(f"\nstep time (median of {args.steps}, interleaved; load average {load0[0]:.1f} -> {load1[0]:.1f} "
        f"on {os.cpu_count()} cores)")
    med = {n: statistics.median(t) for n, t in times.items()}
    base = med.get("dp2")
    # "paired": the median over rounds of (this runner's step / dp2's step in the same round),
    # which cancels load that drifts slower than a round.
    say(f"{'runner':<8} {'ms/step':>9} {'min':>9} {'max':>9} {'vs dp2':>7} {'paired':>7} {'tokens/s':>9}   "
        f"rank 0 median ms: forward / backward / optimizer step")
    for n in names:
        rel = f"{med[n] / base:>7.2f}" if base else f"{'-':>7}"
        paired = (f"{statistics.median(a / d for a, d in zip(times[n], times['dp2'])):>7.2f}" if base
                  else f"{'-':>7}")
        say(f"{n:<8} {1e3 * med[n]:>9.0f} {1e3 * min(times[n]):>9.0f} {1e3 * max(times[n]):>9.0f} {rel} {paired} "
            f"{b * s / med[n]:>9.0f}   "
            + " / ".join(f"{1e3 * statistics.median(phases[n].get(k, [0])):.0f}"
                         for k in ("forward", "backward", "step")))
    if "single" in names:
        say(f"(single: {args.single_threads} intra-op threads on rank 0 while rank 1 waits)")
    say(f"one gloo all-reduce of b*s*h fp32 between the 2 ranks: {ar_ms:.1f} ms "
        f"(tp2 issues {4 * L + 2} of them per step: ~{(4 * L + 2) * ar_ms:.0f} ms if nothing overlaps)")

    say("\ncollectives of one step, counted (elements per call; MiB = payload, wire = ring bytes per rank)")
    say(f"{'runner':<7} {'phase':<9} {'group':<5} {'op':<15} {'calls':>5} {'elements/call':>17} {'MiB':>9} "
        f"{'wire MiB':>9}  theory")
    totals = {}
    for r in runners:
        if r.name == "single":
            continue
        lines, totals[r.name] = count_table(r, args, L)
        for line in lines:
            say(line)
    say("\nper step: " + "; ".join(f"{n} {t['calls']} calls, {t['MiB']:.1f} MiB payload, {t['wire MiB']:.1f} MiB wire"
                                   for n, t in totals.items()))
    if "tp2" in totals:
        per_layer = 4 * b * s * h * 4 / 2**20
        say(f"theory per layer: forward 2 + backward 2 all-reduces of b*s*h = {per_layer:.1f} MiB payload "
            f"(= wire at n = 2, where 2(n-1)/n = 1); x {L} layers = {L * per_layer:.1f} MiB")
    dist.barrier()


if __name__ == "__main__":
    main()
