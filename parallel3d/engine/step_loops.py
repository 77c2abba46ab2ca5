"""How one ``Engine`` runs a batch: one micro-batch at a time, or a pipeline schedule.

The ``Engine`` (parallel3d/engine/engine.py) is the same object on every layout; its ``train_batch``
and ``eval_batch`` hand the micro-batches of one window to a step loop chosen at start-up:

* ``MicroBatchLoop`` (pipeline.stages == 1): the DeepSpeed loop, ``engine(batch)`` ->
  ``engine.backward(loss)`` -> ``engine.step()`` for each micro-batch; the optimizer steps at
  the window's end. The engine's own per-micro-batch calls are available too.
* ``PipelineLoop`` (pipeline.stages > 1): the window's micro-batches go through the
  schedule at once, so there is no per-micro-batch ``forward``/``backward``/``step``. One
  step follows ZeRO's windowed protocol (zero/optimizer.py, ``begin_window`` and after), whose
  gradient-sync sets are this rank's chunks by index (``build/apply.py``, ``_sync_sets``); the
  executor knows only the hooks this loop binds to it (docs/design.md, "A pipeline step").
  Stage 3 gathers this stage's parameters for the step; the executor runs the schedule, and
  around each backward pass that accumulates weight gradients (every ``B``, or ``W`` in
  zero-bubble schedules) ZeRO is told which chunk's sync set it touches and whether it is the
  chunk's last of the step: stages 2-3 reduce-scatter the chunk's gradients after every pass
  and keep only the shard, stages 0-1 (and ``pipeline.keep_full_gradients``) accumulate full gradients
  and reduce the chunk's after its last pass, while the schedule goes on. The tied
  embedding/head gradients are then summed over the first and last stage (full gradients
  before their reduction, shards after it), ZeRO waits for every reduction, unscales, clips
  (the norm summed over pp, the tied copy counted once) and steps the fp32 master shards;
  stage 3 releases its parameters.

Both return losses that are local to this rank; the engine takes their dp mean. Under
``loss_normalization: "tokens"`` each micro-batch's loss is already divided by the global
batch's label tokens (parallel3d/engine/token_mean.py): the loops return their sum, the engine sums
it over dp, and no 1/m scaling applies before backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parallel3d.context_parallel.stages import StageCut
from parallel3d.errors import ConfigError
from parallel3d.pipeline.executor import BackwardPass, PipelineExecutor
from parallel3d.pipeline.stage import sum_tied_grads
from parallel3d.engine.train_state import WindowOutcome

if TYPE_CHECKING:
    from parallel3d.build.parallel_model import ParallelModel
    from parallel3d.config.config import Zero3DConfig
    from parallel3d.engine.engine import Engine


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


def _window_loss(losses: list[torch.Tensor], token_mean: bool) -> torch.Tensor:
    """This rank's part of the window's loss: the mean of the micro-batch losses, or their sum
    when each is already divided by the global label token count."""
    stacked = torch.stack(losses)
    return stacked.sum() if token_mean else stacked.mean()


class MicroBatchLoop:
    """One micro-batch at a time through the engine's own ``forward/backward/step``."""

    per_micro_batch_calls = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def train(self, batches: list) -> WindowOutcome:
        """Forward, backward and step each micro-batch (``engine.step()`` counts them); the
        window's mean loss on this rank."""
        engine, losses = self.engine, []
        for batch in batches:
            loss = loss_of(engine(**batch) if isinstance(batch, dict) else engine(*batch))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return WindowOutcome(_window_loss(losses, self.engine.token_mean))

    def evaluate(self, batches: list) -> torch.Tensor:
        """Forward only; the mean loss of ``batches`` on this rank."""
        engine, losses = self.engine, []
        with torch.no_grad():
            for batch in batches:
                output = engine(**batch) if isinstance(batch, dict) else engine(*batch)
                losses.append(loss_of(output).detach().float())
        return _window_loss(losses, self.engine.token_mean)


class PipelineLoop:
    """A whole window through this pp rank's pipeline schedule (see the module docstring)."""

    per_micro_batch_calls = False

    def __init__(self, parallel: ParallelModel, config: Zero3DConfig, token_mean: bool) -> None:
        """``parallel`` holds the stages (``parallel.pipe``), the mesh and the ZeroOptimizer the
        schedule's passes call; ``token_mean``: each micro-batch's loss is already divided by the
        global batch's label tokens."""
        pipe, mesh, self.zero = parallel.pipe, parallel.mesh, parallel.zero
        self.pipe, self.config, self.token_mean = pipe, config, token_mean
        self.gradient_sum_ranks = mesh.size("dp_cp") if token_mean else 1  # the gradient mean becomes a sum
        # cp > 1: every micro-batch is cut before the stages run it (parallel3d/context_parallel/stages.py)
        split = parallel.sequence_split
        self.stage_cut = StageCut(split, [c.block_indices for c in pipe.chunks]) if split is not None else None
        self.executor = PipelineExecutor(
            pipe,
            mesh.groups.pp,
            config.pipeline.schedule,
            device=mesh.device,
            before_backward=self._begin_pass,
            after_backward=self._end_pass,
            before_weight_group=self.zero.gather_blocks_of,
            around_compute=self.stage_cut.around if self.stage_cut is not None else None,
            sum_tied_grads=False,  # done in train(), on what ZeRO holds
            scale_by_microbatches=not token_mean,  # token-mean losses are divided by the global count
            record=config.pipeline.record_timeline,
        )
        reap = self.zero.reap_reductions
        for chunk in pipe.chunks:  # the hooks live as long as the model's blocks
            for block in chunk.layers:
                block.register_forward_pre_hook(lambda *_: reap())

    def _begin_pass(self, pass_: BackwardPass) -> None:
        # a chunk's index is its gradient-sync set's id in ZeRO (build/apply.py, _sync_sets)
        if pass_.accumulates_weights:
            self.zero.begin_pass(pass_.chunk, last=pass_.is_last)
        else:
            self.zero.begin_input_pass(pass_.chunk)

    def _end_pass(self, pass_: BackwardPass) -> None:
        if pass_.accumulates_weights:
            self.zero.end_pass()
        else:  # an input-gradient pass (zb_h1): its weight pass gathers the blocks again
            self.zero.release_blocks(pass_.chunk)

    def _dicts(self, batches: list) -> list[dict]:
        """The micro-batches as the stages take them: dicts, cut for this cp rank under context parallelism."""
        if not all(isinstance(b, dict) for b in batches):
            raise ConfigError("under pipeline parallelism each micro-batch must be a dict with input_ids and labels")
        return self.stage_cut.cut(batches) if self.stage_cut is not None else batches

    def train(self, batches: list) -> WindowOutcome:
        """One optimizer step over the window's micro-batches: the mean loss (same on every pp
        rank) and whether the step was applied; the engine counts the window."""
        zero = self.zero
        batches = self._dicts(batches)
        zero.begin_window()
        loss = self.executor.run(batches, loss_scale=zero.loss_scale * self.gradient_sum_ranks)
        sum_tied_grads(self.pipe, self.executor.group, grads=zero.tied_gradients([t.param for t in self.pipe.tied]))
        zero.finish_window()
        stepped = zero.step()
        zero.end_window()
        return WindowOutcome(loss, stepped=stepped, micro_batches=len(batches))

    def evaluate(self, batches: list) -> torch.Tensor:
        """Forward only through the stages (GPipe order); the mean loss on every pp rank."""
        zero = self.zero
        batches = self._dicts(batches)
        zero.begin_window()
        with torch.no_grad():
            loss = self.executor.evaluate(batches)
        zero.end_window()
        return loss

    def write_timeline(self, path: str | Path) -> Path | None:
        if not self.config.pipeline.record_timeline:
            raise ConfigError("engine.write_timeline needs pipeline.record_timeline: true in the config")
        return self.executor.write_chrome_trace(path)
