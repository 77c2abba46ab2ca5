"""Pipeline parallelism against its peers: Zero3D's schedules, torch.distributed.pipelining's
and DeepSpeed's PipelineEngine, pp 2 on two ranks.

    python scripts/bench_pp_peers.py [--model A] [--rounds 2] [--steps N] [--warmup N]
        [--only zgpipe,z1f1b,zi1f1b,zzbh1,tgpipe,t1f1b,ti1f1b,tizb,dspipe]

The same seeded Llama (``bench_runners.MODELS``), split the same way (Zero3D's
``split_model`` with ``balance="layers"``: embedding + first half of the blocks on rank 0, the
rest + final norm + head on rank 1; interleaved schedules: two chunks per rank, global stage
``c * 2 + rank``), the same ``PIPELINE_MICRO_BATCHES`` micro-batches per step (copies of one
batch, the same on both ranks), fp32 AdamW, gradient norm clipped to 1.0 over both stages:

* ``zgpipe``, ``z1f1b``, ``zi1f1b`` (V = 2), ``zzbh1``  Zero3D (``pipeline.schedule``), ZeRO 1.
* ``tgpipe``, ``t1f1b``, ``ti1f1b`` (V = 2), ``tizb`` (V = 2)  torch.distributed.pipelining's
  ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, each
  stage a Zero3D ``PipelineStage`` module (the same split), HF's causal-LM loss.
* ``dspipe``  DeepSpeed's PipelineEngine: a ``PipelineModule`` of the same two stage modules,
  ``partition_method="uniform"``, ZeRO 1, its own (1F1B-style) TrainSchedule.

Runs are interleaved step by step in one ``torchrun`` job per round (``bench_tp_peers.drive``),
which prints the median step time and the ratios of each Zero3D schedule to every peer.
"""

from __future__ import annotations

import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_runners import (ADAMW, CLIP, PIPELINE_MICRO_BATCHES, RUNNERS, ds_config,  # noqa: E402
                           setup_zero3d_pipeline)

PP = 2
ZERO3D = {"zgpipe": ("gpipe", 1), "z1f1b": ("1f1b", 1), "zi1f1b": ("interleaved_1f1b", 2), "zzbh1": ("zb_h1", 1)}
TORCH = {"tgpipe": ("ScheduleGPipe", 1), "t1f1b": ("Schedule1F1B", 1), "ti1f1b": ("ScheduleInterleaved1F1B", 2),
         "tizb": ("ScheduleInterleavedZeroBubble", 2)}
NAMES = [*ZERO3D, *TORCH, "dspipe"]
LABEL = {"zgpipe": "Zero3D gpipe", "z1f1b": "Zero3D 1f1b", "zi1f1b": "Zero3D interleaved", "zzbh1": "Zero3D zb_h1",
         "tgpipe": "torch GPipe", "t1f1b": "torch 1F1B", "ti1f1b": "torch Interleaved1F1B",
         "tizb": "torch InterleavedZB", "dspipe": "DeepSpeed PipeEngine"}


def hf_loss(model):
    loss, vocab = model.loss_function, model.config.vocab_size
    return lambda logits, labels: loss(logits=logits, labels=labels, vocab_size=vocab)


def clip_over_world(params, max_norm: float) -> None:
    """Clip the gradients of this rank's stages by the norm over all stages (one all-reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.nn.utils.get_total_norm(grads) ** 2
    dist.all_reduce(sq)
    torch._foreach_mul_(grads, min(1.0, max_norm / (float(sq) ** 0.5 + 1e-6)))


def setup_torch_pipeline(model, spec, stage, schedule="Schedule1F1B", virtual=1, pp=PP,
                         microbatches=PIPELINE_MICRO_BATCHES):
    import torch.distributed.pipelining as tp

    from parallel3d.pipeline.stage import split_model

    rank = dist.get_rank()
    loss_fn = hf_loss(model)
    pipe = split_model(model, pp, rank, virtual_stages=virtual, balance="layers")
    stages = [tp.PipelineStage(chunk, chunk.stage, chunk.total_stages, torch.device("cpu")) for chunk in pipe.chunks]
    cls = getattr(tp, schedule)
    sched = cls(stages if virtual > 1 else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, **ADAMW)
    first, last = any(c.is_first for c in pipe.chunks), any(c.is_last for c in pipe.chunks)

    def step(ids):
        batch = ids.repeat(microbatches, 1)  # split back into the micro-batches by the schedule
        sched.step(*([batch] if first else []), **({"target": batch} if last else {}))
        clip_over_world(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def setup_deepspeed_pipeline(model, spec, stage, pp=PP, microbatches=PIPELINE_MICRO_BATCHES):
    from bench_runners import deepspeed_engine, import_deepspeed
    from models.pipeline_anatomy import pipeline_anatomy
    from parallel3d.pipeline.stage import PipelineStage, make_layout

    PipelineModule = import_deepspeed().pipe.PipelineModule  # noqa: N806 (needs deepspeed.comm set up)
    anatomy = pipeline_anatomy(model)
    layout = make_layout(model, anatomy, pp, balance="layers")
    module = PipelineModule(layers=[PipelineStage(model, anatomy, layout, s) for s in range(pp)], num_stages=pp,
                            loss_fn=hf_loss(model), partition_method="uniform")
    config = ds_config(spec, stage)
    config["gradient_accumulation_steps"] = microbatches
    engine = deepspeed_engine(module, spec, stage, config)

    def step(ids):
        engine.train_batch(iter([(ids, ids)] * microbatches))

    step.engine = engine
    return step, lambda: None


RUNNERS.update({name: (functools.partial(setup_zero3d_pipeline, schedule=s, virtual_stages=v, balance="layers"), 1)
                for name, (s, v) in ZERO3D.items()})
RUNNERS.update({name: (functools.partial(setup_torch_pipeline, schedule=s, virtual=v), 1)
                for name, (s, v) in TORCH.items()})
RUNNERS["dspipe"] = (setup_deepspeed_pipeline, 1)


def main(argv=None) -> dict | None:
    from bench_tp_peers import drive, parse_args, run_job

    args = parse_args(argv, NAMES, doc=__doc__)
    if args.runner:
        return run_job(args, count_comm=False)
    names = [n for n in args.only.split(",") if n]
    if set(names) - set(NAMES):
        raise SystemExit(f"unknown runners {sorted(set(names) - set(NAMES))}; choose from {NAMES}")
    same = dict(zip(ZERO3D, TORCH))  # Zero3D's schedule -> torch's (zb_h1 -> InterleavedZeroBubble)
    return drive(args, names, LABEL, __file__, {z: [same[z], "dspipe"] for z in ZERO3D})


if __name__ == "__main__":
    from parallel3d.runtime.lifeline import exit_now

    main()
    exit_now(0)  # no interpreter teardown: torch 2.13's gloo threads can abort it (parallel3d/runtime/lifeline.py)
