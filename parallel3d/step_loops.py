"""How one ``Engine`` runs a batch: one micro-batch at a time, or a pipeline schedule.

The ``Engine`` (parallel3d/engine.py) is the same object on every layout; its ``train_batch``
and ``eval_batch`` hand the micro-batches of one window to a step loop chosen at start-up:

* ``MicroBatchLoop`` (pipeline.stages == 1): the DeepSpeed loop, ``engine(batch)`` ->
  ``engine.backward(loss)`` -> ``engine.step()`` for each micro-batch; the optimizer steps at
  the window's end. The engine's own per-micro-batch calls are available too.
* ``PipelineLoop`` (pipeline.stages > 1): the window's micro-batches go through the
  schedule at once, so there is no per-micro-batch ``forward``/``backward``/``step``. One
  step, in order: stage 3 gathers this stage's parameters once (``defer_reduction``); the
  executor runs the schedule, its forwards, backwards (and zero-bubble weight passes)
  accumulating full gradients into ZeRO's flat buffers with every hook a no-op, and sums the
  tied embedding/head gradients over the first and last stage; ZeRO then reduces every unit
  over dp once, unscales, clips (the norm summed over pp, the tied copy counted once) and
  steps the fp32 master shards; stage 3 releases its parameters.

Both return losses that are local to this rank; the engine takes their dp mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parallel3d.errors import ConfigError
from parallel3d.pipeline.executor import PipelineExecutor
from parallel3d.pipeline.stage import PipelineModel

if TYPE_CHECKING:
    from parallel3d.engine import Engine


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model output: ``.loss`` (HF), the first element of a tuple, or a tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            "train_batch needs the model to return a scalar loss (an HF output with .loss, "
            "a tuple starting with the loss, or a tensor); pass labels in each batch"
        )
    return loss


class MicroBatchLoop:
    """One micro-batch at a time through the engine's own ``forward/backward/step``."""

    per_micro_batch_calls = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def train(self, batches: list) -> torch.Tensor:
        """Forward, backward and step each micro-batch; the window's mean loss on this rank."""
        engine, losses = self.engine, []
        for batch in batches:
            loss = loss_of(engine(**batch) if isinstance(batch, dict) else engine(*batch))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def evaluate(self, batches: list) -> torch.Tensor:
        """Forward only; the mean loss of ``batches`` on this rank."""
        engine, losses = self.engine, []
        with torch.no_grad():
            for batch in batches:
                output = engine(**batch) if isinstance(batch, dict) else engine(*batch)
                losses.append(loss_of(output).detach().float())
        return torch.stack(losses).mean()

    def named_parameters(self):
        return self.engine.module.named_parameters()


class PipelineLoop:
    """A whole window through this pp rank's pipeline schedule (see the module docstring)."""

    per_micro_batch_calls = False

    def __init__(self, engine: Engine, pipe: PipelineModel) -> None:
        self.engine = engine
        self.pipe = pipe
        config, mesh = engine.config, engine.mesh
        self.executor = PipelineExecutor(
            pipe,
            mesh.group("pp"),
            config.pipeline.schedule,
            device=mesh.device,
            record=config.pipeline.record_timeline,
        )

    @staticmethod
    def _dicts(batches: list) -> list[dict]:
        if not all(isinstance(b, dict) for b in batches):
            raise ConfigError("under pipeline parallelism each micro-batch must be a dict with input_ids and labels")
        return batches

    def train(self, batches: list) -> torch.Tensor:
        """One optimizer step over the window's micro-batches; the mean loss (same on every pp rank)."""
        engine, zero = self.engine, self.engine.optimizer
        batches = self._dicts(batches)
        zero.gather_for_step()
        zero.start_backward(boundary=False)
        loss = self.executor.run(batches, loss_scale=zero.loss_scale)
        zero.reduce_gradients()
        stepped = engine._step_applied = zero.step()
        zero.release_after_forward()
        if stepped and engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
        engine.global_steps += 1
        engine.micro_steps += len(batches)
        engine.global_samples += engine.config.train_batch_size
        return loss

    def evaluate(self, batches: list) -> torch.Tensor:
        """Forward only through the stages (GPipe order); the mean loss on every pp rank."""
        zero = self.engine.optimizer
        batches = self._dicts(batches)
        zero.gather_for_step()
        with torch.no_grad():
            loss = self.executor.evaluate(batches)
        zero.release_after_forward()
        return loss

    def named_parameters(self):
        return self.pipe.hf_named_parameters()

    def write_timeline(self, path: str | Path) -> Path | None:
        if not self.engine.config.pipeline.record_timeline:
            raise ConfigError("engine.write_timeline needs pipeline.record_timeline: true in the config")
        return self.executor.write_chrome_trace(path)
