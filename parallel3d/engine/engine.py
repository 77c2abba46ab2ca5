"""The training engine returned by ``parallel3d.initialize``: DeepSpeed's loop, our ZeRO.

One class for every layout. What differs between a plain data-parallel model and pipeline
stages is how a window of micro-batches runs, and that is the step loop it holds
(parallel3d/engine/step_loops.py); ``train_batch`` and ``eval_batch`` mean the same on all layouts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel3d.runtime.agreement import raise_on_every_rank
from parallel3d.build.compiled_blocks import CompiledBlocks
from parallel3d.engine.batch_check import call_arguments, first_problem, positional_names, vocab_size_of
from parallel3d.compat.deepspeed_surface import CallableInt, DeepSpeedSurface
from parallel3d.checkpoint.partial_load import KeptState, checkpoint_arguments
from parallel3d.errors import ConfigError, NoSyncStageError, UsageError
from parallel3d.build.parallel_model import ParallelModel
from parallel3d.engine.step_loops import MicroBatchLoop, PipelineLoop
from parallel3d.engine import token_mean
from parallel3d.engine.train_state import TrainState
from parallel3d.runtime.watchdog import Watchdog

if TYPE_CHECKING:  # imported by the first save or load: it loads torch.distributed.checkpoint (~0.7 s CPU)
    from parallel3d.checkpoint import checkpoint

logger = logging.getLogger(__name__)


def _explained(method: Callable) -> Callable:
    """A collective that times out or loses a peer inside ``method`` raises an explained
    `CollectiveError` (parallel3d/runtime/watchdog.py) instead of the backend's bare message."""
    @functools.wraps(method)
    def wrapper(self: Engine, *args, **kwargs):
        if self.watchdog is None:
            return method(self, *args, **kwargs)
        with self.watchdog.explaining():
            return method(self, *args, **kwargs)

    return wrapper


class Engine(DeepSpeedSurface):
    """Wraps a model and its ZeRO optimizer; one instance per rank.

    ``train_batch`` runs a whole ``gradient_accumulation_steps`` window on every layout. Without
    pipeline stages the model can also be called directly: ``engine(batch)``, ``backward``
    then ``step`` every micro-batch (the optimizer steps at the end of each window).
    DeepSpeed's engine getters, ``destroy`` and attribute forwarding to ``module`` come from
    ``DeepSpeedSurface`` (parallel3d/compat/deepspeed_surface.py).
    """

    def __init__(
        self,
        parallel: ParallelModel,
        config,
        lr_scheduler=None,
        client_optimizer: torch.optim.Optimizer | None = None,
        watchdog: Watchdog | None = None,
        compiled: CompiledBlocks | None = None,
        expert_bias=None,
    ) -> None:
        self.parallel = parallel  # the model's parts on this rank, as initialize's apply steps made them
        module, pipe = parallel.module, parallel.pipe
        self.client_optimizer = client_optimizer
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.expert_bias = expert_bias  # load_balance_coeff's router-bias updates (ExpertBiasBalancer) or None
        self.gradient_accumulation_steps = CallableInt(config.gradient_accumulation_steps)  # also DeepSpeed's getter
        self.train_state = TrainState()  # the counters: written here only (parallel3d/engine/train_state.py)
        self._backward_pending = False  # a backward ran for the current micro-batch, its step not yet
        self._in_no_sync = False  # inside no_sync(): backward accumulates, reduces nothing
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary()
        self.token_mean = config.loss_normalization == "tokens"  # parallel3d/engine/token_mean.py
        self.loop = PipelineLoop(parallel, config, self.token_mean) if pipe is not None else MicroBatchLoop(self)
        self._pending_save: checkpoint.BackgroundSave | None = None
        self._save_group: dist.ProcessGroup | None = None  # async saves' own collectives
        self._staging: checkpoint.StagingBuffer | None = None  # async saves' CPU copy, reused
        self.watchdog = watchdog
        self._vocab_size = vocab_size_of(module)  # token ids are checked against it (parallel3d/engine/batch_check.py)
        self._arg_names = positional_names(module)  # how a tuple micro-batch's items are named there
        # packed batches need use_cache=False where the model would make a cache (a pipeline's stages never do)
        self._cache_on = pipe is None and bool(getattr(getattr(module, "config", None), "use_cache", False))
        self._batches_checked = False  # inside train_batch/eval_batch: forward need not check again
        self.compiled = compiled  # the blocks compiled by config or engine.compile() (parallel3d/build/compiled_blocks.py)
        if watchdog is not None:
            weakref.finalize(self, watchdog.close)  # the heartbeat thread ends with the engine

    # The parts, read from the record (DeepSpeed's `module` and `optimizer`; the others Zero3D's)
    module = property(lambda self: self.parallel.module, doc="the model as the apply steps left it")
    optimizer = property(lambda self: self.parallel.zero, doc="the ZeroOptimizer")
    mesh = property(lambda self: self.parallel.mesh)
    device = property(lambda self: self.parallel.mesh.device)
    tp_info = property(lambda self: self.parallel.tp, doc="tensor parallelism's record, or None")
    pipe = property(lambda self: self.parallel.pipe, doc="this rank's pipeline chunks, or None")
    ep_info = property(lambda self: self.parallel.ep, doc="expert parallelism's record, or None")
    sequence_split = property(lambda self: self.parallel.sequence_split, doc="cp > 1: each micro-batch's cut")

    # -- the DeepSpeed loop --------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _per_micro_batch_call(self, what: str) -> None:
        if not self.loop.per_micro_batch_calls:
            raise ConfigError(
                f"engine.{what} is not available with pipeline.stages > 1: a pipeline runs whole batches "
                "through its schedule; use engine.train_batch(data_iter) or engine.eval_batch(data_iter)"
            )

    @_explained
    def forward(self, *args, **kwargs):
        self._per_micro_batch_call("forward (engine(...))")
        if not self._batches_checked:
            self._check_call(call_arguments(args, kwargs, self._arg_names))
        self.optimizer.gather_for_forward()
        if torch.is_grad_enabled():  # gradients may arrive from here on (see GradientReducer.start_backward)
            self.optimizer.start_backward(self._reduces_now())
        if self.compiled is not None and self._cache_on and self.module.training and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}  # a cache per layer would recompile each block
        if self.sequence_split is not None:
            output = self.sequence_split.run(self.module, call_arguments(args, kwargs, self._arg_names))
        else:
            output = self.module(*args, **kwargs)
        self.optimizer.end_forward()
        return output

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual accumulation boundary, which then replaces the micro-batch count.

        While it is False, ``engine.backward`` may run any number of times with no
        ``engine.step()`` between (gradients accumulate; stages 0-1 reduce nothing yet, stages
        2-3 reduce into the shard as always), and a ``step()`` only counts a micro-batch. Set it
        to True before the window's last backward: that backward reduces, and the next
        ``step()`` steps the optimizer. It stays as set until set again.
        """
        self._per_micro_batch_call("set_gradient_accumulation_boundary()")
        if not isinstance(is_boundary, bool):
            raise ConfigError(f"set_gradient_accumulation_boundary(is_boundary={is_boundary!r}): expected True or False")
        self._boundary_override = is_boundary

    def _accumulating_by_hand(self) -> bool:
        """Backward passes accumulate without a step between (no_sync, or a boundary set to False)."""
        return self._in_no_sync or self._boundary_override is False

    def _reduces_now(self) -> bool:
        """Whether this micro-batch's backward reduces the window's gradients."""
        return self.is_gradient_accumulation_boundary() and not self._in_no_sync

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's (and DDP's) ``no_sync``: backward passes inside accumulate their gradients
        locally and reduce nothing; the next backward outside reduces them with its own. Any
        number of backward passes may run inside; ``step()`` may not. ZeRO stages 0 and 1 only,
        as in DeepSpeed: stages 2 and 3 keep only a shard of each gradient, so they must reduce
        every backward's."""
        self._per_micro_batch_call("no_sync()")
        stage = self.config.zero_optimization.stage
        if stage >= 2:
            raise NoSyncStageError(f"engine.no_sync() needs ZeRO stage 0 or 1, not {stage}: stages 2 and 3 keep "
                                   "only this rank's shard of each gradient, so every backward reduces its gradients")
        if self._in_no_sync:
            raise UsageError("engine.no_sync() is already active; it cannot be nested")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    @_explained
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale); returns the divided loss.

        With ``loss_normalization: "tokens"`` the loss is one the model divided by the global
        batch's label tokens (``num_items_in_batch``, which ``engine(...)`` insists on): it is not
        divided by the accumulation steps but multiplied by the data-parallel size, so that the dp
        average of the gradients is their sum (parallel3d/engine/token_mean.py); ``scale_wrt_gas`` does
        not apply.

        DeepSpeed's order of operations, so that fp16 overflows the same way: the loss is
        divided by the accumulation steps in its own dtype first, then multiplied by the loss
        scale (multiplying once by scale / steps would let a scale of 2**16 through where
        DeepSpeed's gradient overflows). ``scale_wrt_gas=False`` skips the division.
        """
        self._per_micro_batch_call("backward")
        if self._backward_pending and not self._accumulating_by_hand():
            raise UsageError("engine.backward() was called twice for one micro-batch; call engine.step() "
                             "after each engine.backward() (the loop is engine(batch) -> backward(loss) -> step())")
        if self.token_mean:  # the mean over dp_cp (parallel3d/runtime/mesh.py) becomes a sum
            loss = loss * self.mesh.size("dp_cp") if self.mesh.size("dp_cp") > 1 else loss
        elif scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps
        scale = self.optimizer.loss_scale
        self.optimizer.start_backward(self._reduces_now())
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        self.optimizer.finish_backward()
        self._backward_pending = not self._accumulating_by_hand()
        return loss

    @_explained
    def step(self) -> None:
        """Count a micro-batch; at a window's end, step the optimizer and the LR schedule."""
        self._per_micro_batch_call("step")
        if self._in_no_sync:
            raise UsageError("engine.step() inside engine.no_sync(): leave the context and run the micro-batch's "
                             "last engine.backward(loss) outside it, then step")
        if not self._backward_pending and self._boundary_override is not False:
            raise UsageError("engine.step() without engine.backward(loss) for this micro-batch; the loop is "
                             "engine(batch) -> engine.backward(loss) -> engine.step()")
        self._backward_pending = False
        if self.is_gradient_accumulation_boundary():
            self._end_window(self.optimizer.step())
            self._surface_finished_save()
        self.train_state.micro_steps += 1

    def _end_window(self, stepped: bool) -> None:
        """An optimizer step ended a window: the routers' expert biases follow the window's loads (also
        after a step skipped for overflow, as Megatron's); the LR schedule moves if it was applied; the counters."""
        if self.expert_bias is not None:
            self.expert_bias.update()
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.train_state.end_window(stepped, self.config.train_batch_size)

    def load_train_state(self, state: dict[str, int]) -> None:
        """Set the counters from a saved ``TrainState.state_dict()`` (a checkpoint's, or the
        engine's own before a partial load)."""
        self.train_state.load_state_dict(state)

    # DeepSpeed's counter attributes, read from (and, as DeepSpeed's are plain attributes, written to) the state
    global_steps = property(lambda self: self.train_state.global_steps,
                            lambda self, value: setattr(self.train_state, "global_steps", int(value)))
    micro_steps = property(lambda self: self.train_state.micro_steps,
                           lambda self, value: setattr(self.train_state, "micro_steps", int(value)))
    global_samples = property(lambda self: self.train_state.global_samples,
                              lambda self, value: setattr(self.train_state, "global_samples", int(value)))

    @_explained
    def train_batch(self, data_iter: Iterator) -> float:
        """Run one optimizer step over ``gradient_accumulation_steps`` micro-batches.

        Each item of ``data_iter`` is a dict of model keyword arguments (with labels) or, without
        pipeline stages, a tuple of positional ones. Returns the mean loss of the batch over all
        dp ranks (the same value on every rank): the mean of the micro-batch losses, or with
        ``loss_normalization: "tokens"`` the mean over the global batch's label tokens.
        """
        batches = [self._next_micro_batch(data_iter, i) for i in range(self.gradient_accumulation_steps)]
        self._check_batches(batches, "train_batch")
        with self._checked():
            outcome = self.loop.train(self._counted([self._to_device(b) for b in batches]))
            if outcome.stepped is not None:  # the loop stepped the optimizer itself: count its window here
                self._end_window(outcome.stepped)
                self.train_state.micro_steps += outcome.micro_batches
        value = self._dp_mean(outcome.loss)
        self._surface_finished_save()
        if self.global_steps % self.config.steps_per_print == 0 and self._is_rank0():
            logger.info("step %d loss %.6f lr %s", self.global_steps, value, self.get_lr())
        return value

    @_explained
    def eval_batch(self, data_iter: Iterator, num_micro_batches: int | None = None) -> float:
        """Forward only over ``num_micro_batches`` micro-batches (default: one window's worth).

        Returns their mean loss over all dp ranks, on every layout, so evaluation code need not
        ask which layout it runs on. Train/eval mode is the caller's (``engine.eval()``).
        """
        count = self.gradient_accumulation_steps if num_micro_batches is None else num_micro_batches
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(f"eval_batch: num_micro_batches must be a positive int, got {num_micro_batches!r}")
        batches = [self._next_micro_batch(data_iter, i, count) for i in range(count)]
        self._check_batches(batches, "eval_batch")
        with self._checked():
            return self._dp_mean(self.loop.evaluate(self._counted([self._to_device(b) for b in batches])))

    def _check_call(self, call: dict) -> None:
        """Refuse a direct ``engine(...)`` call's batch on every rank if any rank's is invalid (one
        all-reduce of a flag): a rank raising alone would leave the others waiting in the forward's
        or backward's collectives until the timeout. A forward with no collective in it (no_grad at
        ZeRO 0-2 without tp or cp: an evaluation on rank 0 alone) checks locally instead. Under ``loss_normalization: "tokens"`` a call
        with labels must carry ``num_items_in_batch`` (`token_mean.call_problem`). Under context parallelism
        the cp ranks must have been handed the same micro-batch, as in ``train_batch``."""
        problem = first_problem([call], self._vocab_size, cache_on=self._cache_on)
        if problem is None and self.token_mean:
            problem = token_mean.call_problem(call)
        if self.sequence_split is not None:  # as _check_batches: the cp group's agreement, on every rank
            differing = self.sequence_split.differing([call], self.device)
            problem = problem or self.sequence_split.problem(call) or differing
        error = ConfigError(f"engine(...){self._on_rank()}: {problem}") if problem is not None else None
        if not (torch.is_grad_enabled() or self.optimizer.settings.stage == 3 or self.mesh.tp > 1 or self.mesh.cp > 1):
            # a forward without collectives (evaluation under no_grad, ZeRO 0-2, no tp or cp) may run on
            # some ranks only, as in DeepSpeed: its check stays local, and so does its error
            if error is not None:
                raise error
            return
        raise_on_every_rank(error, self.device)

    @staticmethod
    def _on_rank() -> str:
        """" on rank N" where there are several ranks, for messages raised on all of them."""
        return f" on rank {dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""

    def _check_batches(self, batches: list, what: str) -> None:
        """Raise one ConfigError on every rank if any rank's micro-batches hold token ids outside the
        vocabulary, or are empty (one all-reduce of a flag; the batches are checked where they are)."""
        problem = first_problem(batches, self._vocab_size, self._arg_names, self._cache_on)
        if problem is None and self.token_mean:
            problem = next((p for p in map(token_mean.batch_problem, batches) if p is not None), None)
        if self.sequence_split is not None:  # the cp group's agreement is a collective: every rank takes part
            differing = self.sequence_split.differing(batches, self.device)
            problem = problem or next((p for p in map(self.sequence_split.problem, batches) if p is not None), differing)
        raise_on_every_rank(ConfigError(f"{what}{self._on_rank()}: {problem}") if problem is not None else None,
                            self.device)

    @contextlib.contextmanager
    def _checked(self):
        self._batches_checked = True
        try:
            yield
        finally:
            self._batches_checked = False

    def _next_micro_batch(self, data_iter: Iterator, index: int, count: int | None = None):
        """The next micro-batch, or a message saying the iterator ran out in the middle of a window."""
        try:
            return next(data_iter)
        except StopIteration:
            needs = (f"{self.gradient_accumulation_steps} micro-batches (gradient_accumulation_steps) one batch needs"
                     if count is None else f"{count} micro-batches asked for")
            raise UsageError(f"data_iter ran out after {index} of the {needs}") from None

    def _counted(self, batches: list) -> list:
        """Under ``loss_normalization: "tokens"``, the micro-batches with the step's global label
        token count as ``num_items_in_batch`` (one all-reduce over dp); else as they are."""
        if not self.token_mean:
            return batches
        return token_mean.with_num_items(batches, token_mean.global_label_tokens(batches, self.mesh.dp_group,
                                                                                self.device))

    def _dp_mean(self, loss: torch.Tensor) -> float:
        """The loss of the global batch from this rank's part (the same value on all of them): the
        mean over the data- and context-parallel ranks, or their sum when each part is already
        divided by the global token count (``loss_normalization: "tokens"``)."""
        group = self.mesh.groups.gradient_mean
        if group is not None and self.mesh.size("dp_cp") > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM if self.token_mean else dist.ReduceOp.AVG, group=group)
        return float(loss)

    def _to_device(self, batch):
        if isinstance(batch, dict):
            return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(v.to(self.device) if isinstance(v, torch.Tensor) else v for v in batch)
        raise ConfigError(f"train_batch expects dicts or tuples from data_iter, got {type(batch).__name__}")

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @staticmethod
    def _is_rank0() -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    # -- state ---------------------------------------------------------------------------

    def memory_report(self, experts: bool | None = None) -> dict[str, int]:
        """Bytes of model state on this rank: params, gradients, master params, optimizer states; with
        ``experts`` True (False) those of the expert-parallel parameters only (of the others)."""
        return self.optimizer.memory_report(experts)

    def named_parameters(self):
        """(HF name, parameter) of the parameters this rank trains."""
        return self.parallel.named_parameters()

    def write_timeline(self, path: str | Path) -> Path | None:
        """Write the last step's per-rank pipeline action timeline as a Chrome trace (collective over pp).

        Needs pipeline stages and ``pipeline.record_timeline: true``; rank 0 of the pp group writes it.
        """
        if not isinstance(self.loop, PipelineLoop):
            raise ConfigError("engine.write_timeline needs pipeline.stages > 1 (it records the pipeline schedule)")
        return self.loop.write_timeline(path)

    @_explained
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter by name, whole and in fp32 (collective over dp and tp).

        Tensor-parallel shards are gathered over tp and reassembled as the unmodified model
        would hold them (vocabulary padding removed); expert-parallel ranks' experts are gathered
        over the expert-parallel group in expert order.
        """
        by_param = self.optimizer.full_fp32_params()
        full = {name: by_param[p] for name, p in self.named_parameters() if p in by_param}
        if self.tp_info is not None:
            for name, spec in self.tp_info.shard_specs.items():
                if name in full:
                    shards = [torch.empty_like(full[name]) for _ in range(self.mesh.tp)]
                    dist.all_gather(shards, full[name], group=self.mesh.groups.tp)
                    full[name] = spec.unshard(shards)
        if self.ep_info is not None:
            for name in self.ep_info.params:
                if name in full:
                    parts = [torch.empty_like(full[name]) for _ in range(self.ep_info.size)]
                    dist.all_gather(parts, full[name], group=self.ep_info.group)
                    full[name] = torch.cat(parts)
        return full

    @_explained
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Save the training state under ``save_dir/tag`` (default ``global_step{N}``); collective.

        Mesh-free: every tensor under its Hugging Face name and full shape (parallel3d/checkpoint/checkpoint.py).
        ``client_state`` (None, bool, int, float, str, lists, dicts with string keys, tensors) is
        stored as rank 0 passes it and handed back by ``load_checkpoint``. Returns the tag.
        Frozen parameters are never written (they come from the model the loading script builds),
        so ``exclude_frozen_parameters`` is accepted with either value; ``save_latest`` must be True.
        """
        from parallel3d.checkpoint import checkpoint

        checkpoint_arguments(save_latest=save_latest)
        if self.micro_steps % self.gradient_accumulation_steps:
            raise ConfigError(
                f"save_checkpoint in the middle of a gradient accumulation window (micro-step "
                f"{self.micro_steps}, gradient_accumulation_steps {self.gradient_accumulation_steps}): "
                "accumulated gradients are not saved, so save after engine.step() ends a window"
            )
        self.wait_for_checkpoint()
        background = self.config.checkpoint.async_save
        if background and self._save_group is None and dist.is_initialized():
            timeout = timedelta(seconds=self.mesh.timeout_s) if self.mesh.timeout_s is not None else None
            self._save_group = dist.new_group(backend="gloo", timeout=timeout)
        if background and self._staging is None:
            self._staging = checkpoint.StagingBuffer()
        tag, self._pending_save = checkpoint.save(self, save_dir, tag, client_state or {}, self._save_group,
                                                  staging=self._staging if background else None)
        return tag

    @_explained
    def wait_for_checkpoint(self) -> None:
        """Wait until a background save (``checkpoint.async_save``) is written and published."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.finish()

    @property
    def save_in_flight(self) -> bool:
        """Whether a background save has started and not yet been published (and checked)."""
        return self._pending_save is not None

    def _surface_finished_save(self) -> None:
        """Finish a background save whose thread has ended on every rank, raising its error now
        rather than at the next save. The ranks agree first (one one-element all-reduce per step,
        only while a save is in flight), so all of them raise at the same step."""
        if self._pending_save is None:
            return
        done = torch.tensor([float(not self._pending_save.is_alive())], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self.wait_for_checkpoint()

    @_explained
    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None) -> tuple[str | None, dict | None]:
        """Restore the state written by ``save_checkpoint`` on any layout, ZeRO stage and world size.

        Returns ``(checkpoint_path, client_state)`` like DeepSpeed (``client_state`` as rank 0
        saved it); ``(None, None)`` with a warning, as DeepSpeed, when ``load_dir`` is a directory
        without a ``latest`` checkpoint and no ``tag`` is named (a directory that does not exist
        is an error: a mistyped path would otherwise train from scratch). As in DeepSpeed, ``load_optimizer_states=False`` loads the weights but keeps
        the optimizer's states, options and loss scaler; ``load_lr_scheduler_states=False`` keeps
        the LR scheduler; ``load_module_only=True`` loads the weights alone (step counters and
        RNG states stay as well).
        """
        from parallel3d.checkpoint import checkpoint

        checkpoint_arguments(load_module_strict=load_module_strict, custom_load_fn=custom_load_fn)
        self.wait_for_checkpoint()
        kept = KeptState(self, scheduler=load_module_only or not load_lr_scheduler_states, training=load_module_only)
        try:
            path, client_state = checkpoint.load(self, load_dir, tag,
                                                 optimizer_states=load_optimizer_states and not load_module_only)
        except checkpoint.NoCheckpointYet as nothing:
            logger.warning("%s: nothing was loaded", nothing)
            return None, None
        kept.restore()
        return path, client_state
