"""The engine under pipeline parallelism: whole batches through a schedule, ZeRO on each stage.

A pipeline runs the ``gradient_accumulation_steps`` micro-batches of a batch through its
schedule at once, so there is no per-micro-batch ``forward``/``backward``/``step``: only
``train_batch`` and ``eval_batch``. One step, in order:

1. stage 3: gather this stage's parameters once for the whole step (``defer_reduction``);
2. the executor runs the schedule: forwards, backwards (and zero-bubble weight passes)
   accumulate full gradients into ZeRO's flat buffers, every hook a no-op;
3. the executor sums the tied embedding/head gradients across the first and last stage;
4. ZeRO reduces every unit over dp once, then unscales, clips (the norm summed over pp, the
   tied copy counted once) and steps the fp32 master shards; stage 3 releases its params.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from parallel3d.engine import Engine
from parallel3d.errors import ConfigError
from parallel3d.pipeline.executor import PipelineExecutor
from parallel3d.pipeline.stage import PipelineModel


class PipelineEngine(Engine):
    """``Engine`` for ``pipeline.stages > 1`` (see the module docstring)."""

    def __init__(self, module: nn.Module, config, mesh, optimizer, lr_scheduler, pipe: PipelineModel, tp_info=None) -> None:
        super().__init__(module, config, mesh, optimizer, lr_scheduler, tp_info=tp_info)
        self.pipe = pipe
        self.executor = PipelineExecutor(
            pipe,
            mesh.group("pp"),
            config.pipeline.schedule,
            device=mesh.device,
            record=config.pipeline.record_timeline,
        )

    def _per_micro_batch_call(self, what: str):
        raise ConfigError(
            f"engine.{what} is not available with pipeline.stages > 1: a pipeline runs whole batches "
            "through its schedule; use engine.train_batch(data_iter) or engine.eval_batch(data_iter)"
        )

    def forward(self, *args, **kwargs):
        self._per_micro_batch_call("forward (engine(...))")

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        self._per_micro_batch_call("backward")

    def step(self) -> None:
        self._per_micro_batch_call("step")

    def named_parameters(self):
        return self.pipe.hf_named_parameters()

    def _micro_batches(self, data_iter: Iterator) -> list[dict]:
        gas = self.gradient_accumulation_steps
        batches = [self._to_device(self._next_micro_batch(data_iter, i)) for i in range(gas)]
        if not all(isinstance(b, dict) for b in batches):
            raise ConfigError("under pipeline parallelism each micro-batch must be a dict with input_ids and labels")
        return batches

    def train_batch(self, data_iter: Iterator) -> float:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; the dp-mean loss."""
        micro_batches = self._micro_batches(data_iter)
        zero = self.optimizer
        zero.gather_for_step()
        zero.start_backward(boundary=False)
        loss = self.executor.run(micro_batches, loss_scale=zero.loss_scale)
        zero.reduce_gradients()
        stepped = zero.step()
        zero.release_after_forward()
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.micro_steps += self.gradient_accumulation_steps
        self.global_samples += self.config.train_batch_size
        return self._dp_mean(loss)

    def eval_batch(self, data_iter: Iterator) -> float:
        """Forward only over ``gradient_accumulation_steps`` micro-batches; the dp-mean loss."""
        micro_batches = self._micro_batches(data_iter)
        self.optimizer.gather_for_step()
        with torch.no_grad():
            loss = self.executor.evaluate(micro_batches)
        self.optimizer.release_after_forward()
        return self._dp_mean(loss)

    def write_timeline(self, path: str | Path) -> Path | None:
        """Write the last step's per-rank action timeline as a Chrome trace (collective over pp).

        Needs ``pipeline.record_timeline: true``; rank 0 of the pp group writes the file.
        """
        if not self.config.pipeline.record_timeline:
            raise ConfigError("engine.write_timeline needs pipeline.record_timeline: true in the config")
        return self.executor.write_chrome_trace(path)
