"""One rank of a job, in this process, on torch's fake backend: build, train a few steps, measure.

    python -m parallel3d.simulate.rank SPEC.json OUT.json

The process joins a fake default process group as rank ``rank`` of ``world``
(``init_process_group("fake", store=FakeStore(), ...)``): every collective returns at once and
moves nothing, so this rank runs exactly what it would run in the real job (its own tensor
parallel shards, pipeline stage and ZeRO shards, the real forward, backward and optimizer step
at the real sequence length and micro-batch) with the real allocations. The model is built on
the meta device and goes through the normal ``parallel3d.initialize`` path, so only this rank's
share is ever materialized. Receive buffers are zero-filled on the fake backend
(parallel3d/runtime/fake_backend.py): the step is never skipped for garbage gradients.

One departure from a real start: the values. ``initialize`` normally fills a meta model with
what eager construction would give (``models.materialize.InitReplay``), which replays the whole
model's random draws on every rank: minutes of CPU for a 7B model, for values a simulation does
not need (its peers send zeros anyway). :class:`DrawnValues` keeps the replay's names, shapes,
tying and buffers and draws each parameter rectangle the rank asks for from N(0, 0.02) instead,
into the same ZeRO buffers; what is allocated is the same.

Measured: on CUDA the allocator's peak (``torch.cuda.max_memory_allocated``) and reserved
bytes; on CPU the peak of tensor bytes alive (every storage created from before
``initialize`` on, the figure CUDA's allocator would report without rounding and cache;
``planner.profile.LiveBytes``) and the process's peak resident set (VmHWM). Both also get
``engine.memory_report()`` after the last step.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class RankSpec:
    """What one simulated rank runs: the layout is in ``config`` (the engine config, built by ``cli.py``)."""

    model: str
    rank: int
    world: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    config: dict
    checkpointing_without_pipeline: bool = False
    steps: int = 2
    device: str = "cpu"
    trust_remote_code: bool = False


class DrawnValues:
    """A ``models.tensor_source`` for a simulated rank: ``InitReplay``'s names, aliases and buffers
    (the buffers draw nothing), each requested parameter rectangle drawn from N(0, ``std``)."""

    def __init__(self, replay, std: float = 0.02) -> None:
        self.replay, self.std = replay, std

    def names(self) -> list[str]:
        return self.replay.names()

    def aliases(self) -> dict[str, str]:
        return self.replay.aliases()

    def shape(self, name: str) -> torch.Size:
        return self.replay.shape(name)

    def buffer_names(self, *, persistent: bool | None = None) -> list[str]:
        return self.replay.buffer_names(persistent=persistent)

    def buffers(self):
        return self.replay.buffers()

    def fill(self, destinations) -> None:
        with torch.no_grad():
            for items in destinations.values():
                for _, dest in items:
                    dest.normal_(0.0, self.std)


def _drawn_source(model):
    """``initialize``'s ``take_source`` for a simulated rank (see the module docstring)."""
    from parallel3d.build.meta_init import take_source

    return DrawnValues(take_source(model))


def _status_bytes(name: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{name}:\s+(\d+) kB", f.read(), re.M)
    return int(match[1]) * 1024 if match else 0


def _reset_rss_peak() -> None:
    """Start VmHWM again from the current resident set (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        logger.info("cannot reset the resident-set peak here: VmHWM includes initialize")


def _tracker():
    """Storage bytes alive (no per-op records: a long run keeps none)."""
    from parallel3d.planner.profile import LiveBytes

    class StorageBytes(LiveBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._track(t.untyped_storage())
            return out

    return StorageBytes()


def _batches(vocab: int, spec: RankSpec, step: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * step + spec.rank)
    for _ in range(spec.grad_accum):
        ids = torch.randint(0, vocab, (spec.micro_batch, spec.seq_len), generator=g).to(device)
        yield {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def _values_drawn():
    init_module = importlib.import_module("parallel3d.initialize")  # the module, not the function the package exports
    original = init_module.take_source
    init_module.take_source = _drawn_source
    try:
        yield
    finally:
        init_module.take_source = original


def simulate(spec: RankSpec) -> dict:
    """Run ``spec``'s rank for ``spec.steps`` optimizer steps; its measurements as plain values."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    import parallel3d
    from parallel3d.errors import ConfigError
    from parallel3d.planner.cli import load_model

    device = torch.device(spec.device)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=spec.rank, world_size=spec.world)
    rss_start = _status_bytes("VmRSS")
    live = _tracker()
    started = time.perf_counter()
    with live:
        model = load_model(spec.model, spec.trust_remote_code)
        if spec.checkpointing_without_pipeline:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ConfigError(f"{type(model).__name__} does not support activation checkpointing without "
                                  "pipeline stages (transformers' gradient_checkpointing_enable)")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        vocab = model.config.vocab_size
        with _values_drawn():
            engine, *_ = parallel3d.initialize(model=model, config=spec.config, device=device)
        del model
        init_s = time.perf_counter() - started
        init_peak = live.peak
        live.reset_peak()  # the steps' peak: initialize's transients (the replay's buffers) are not the job's
        _reset_rss_peak()
        if cuda:
            init_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        step_s = []
        for step in range(spec.steps):
            t = time.perf_counter()
            engine.train_batch(iter(list(_batches(vocab, spec, step, device))))
            if cuda:
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t)
    skipped = int(engine.optimizer.skipped_steps)
    if skipped:
        raise RuntimeError(f"{skipped} of {spec.steps} simulated steps were skipped (gradient overflow), so the "
                           "optimizer's memory was not allocated as in a real step")
    out = {
        "rank": spec.rank, "world": spec.world,
        "pp_rank": engine.mesh.local_rank("pp"), "dp_rank": engine.mesh.local_rank("dp"),
        "tp_rank": engine.mesh.local_rank("tp"),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "memory_report": {k: int(v) for k, v in engine.memory_report().items()},
        "tensor_peak_bytes": int(live.peak), "init_peak_bytes": int(init_peak),
        "rss_peak_bytes": _status_bytes("VmHWM"), "rss_start_bytes": rss_start,
        "init_seconds": init_s, "step_seconds": step_s, "steps": spec.steps,
    }
    if cuda:
        out["cuda_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["cuda_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    out["measured_peak_bytes"] = out["cuda_peak_allocated_bytes"] if cuda else out["tensor_peak_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Child process entry: read the spec, simulate, write the result (or the one error) as JSON."""
    from parallel3d.errors import ConfigError
    from parallel3d.runtime.lifeline import exit_now
    from parallel3d.planner.cli import quiet_transformers

    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = RankSpec(**json.loads(Path(spec_path).read_text()))
    logging.basicConfig(level=logging.WARNING)
    quiet_transformers()
    try:
        result = simulate(spec)
    except (ConfigError, RuntimeError, ValueError) as exc:
        why = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        result = {"rank": spec.rank, "error": why}
    Path(out_path).write_text(json.dumps(result))
    sys.stdout.flush()
    exit_now(0)  # no interpreter teardown of a multi-GiB rank (and of the fake group's threads)
    return 0


if __name__ == "__main__":
    main()
