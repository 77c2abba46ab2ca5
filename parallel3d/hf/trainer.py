"""``parallel3d.hf.Trainer``: ``transformers.Trainer`` training through a Zero3D engine.

The Trainer keeps its loop (epochs, accumulation windows, logging, callbacks, evaluation,
checkpoint rotation); Zero3D replaces what accelerate and DeepSpeed do inside it:

* the model is sharded once, in ``__init__``, by ``parallel3d.initialize`` with the
  Trainer's optimizer (``args.optim``, its decay/no-decay groups) or the config's; the LR
  schedule is attached when ``train()`` knows the number of steps (``args.lr_scheduler_type``
  or the config's ``scheduler``), and the engine steps it;
* each micro-batch's ``training_step`` calls the engine: ``compute_loss`` (so subclasses such as
  TRL's still shape the loss) -> ``engine.backward`` -> ``engine.step``, with the accumulation
  boundary the Trainer's loop decided; with pipeline stages the window's micro-batches go
  through ``engine.train_batch`` at its last one;
* data is sharded over data-parallel ranks only (tensor- and pipeline-parallel ranks of one
  replica see the same batches), evaluation runs ``compute_loss`` through the engine or
  ``eval_batch`` on pipeline stages, and checkpoints are the engine's (parallel3d/hf/saving.py).

The loss normalization: with labels and a model that takes ``num_items_in_batch`` the Trainer
divides each micro-batch's summed token loss by the step's label tokens counted over all ranks
and multiplies by the number of ranks whose gradients are averaged (``num_processes //
get_tp_size()``). ``get_tp_size`` answers the ranks that share one batch (tp x pp), so that
factor is the dp size and the engine's dp mean of gradients gives the token mean. Under the
config's ``loss_normalization: "tokens"`` the engine itself multiplies by dp in backward, so
the Trainer's factor is made 1 while ``training_step`` computes the loss (else dp would count
twice). Pipeline stages default to ``"tokens"`` for the same reason the Trainer counts tokens.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch
import transformers
from accelerate.utils.memory import clear_device_cache

import parallel3d
from parallel3d.errors import ConfigError, UsageError
from parallel3d.compat.gathered import GatheredParameters
from parallel3d.hf.config_fill import scheduler_section, trainer_config
from parallel3d.hf.data import gather_over_dp, shard_over_dp
from parallel3d.hf.engine_views import EngineModel, EngineOptimizer, EngineScheduler
from parallel3d.hf.launch_check import refuse_accelerate_launch, refuse_competing_arguments
from parallel3d.hf.model_source import meta_model
from parallel3d.hf.saving import engine_dir, export_model
from parallel3d.lr.build import build_lr_scheduler
from parallel3d.runtime.worker_errors import install as install_worker_errors


class Zero3DTrainerMixin:
    """Mix in before a ``transformers.Trainer`` subclass (``class T(Zero3DTrainerMixin, SFTTrainer)``)."""

    engine: Any = None

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, zero3d_config: Any = None,
                 trust_remote_code: bool = False, **kwargs: Any) -> None:
        install_worker_errors()  # under torchrun: a ConfigError ends each worker with one line
        if zero3d_config is None:
            raise ConfigError("parallel3d.hf.Trainer needs zero3d_config= (a Zero3D/DeepSpeed config dict or the path "
                              "of its .json/.yaml file)")
        refuse_accelerate_launch()
        if args is not None:
            refuse_competing_arguments(args, kwargs.get("model_init"))
        pretrained = None
        if isinstance(model, (str, os.PathLike)):
            pretrained, model = str(model), meta_model(model, trust_remote_code)
        self._tokens_factor_off = False
        self._window: list[dict] = []
        self._step_lr: float | None = None  # the learning rate the last optimizer step used
        super().__init__(model, args, *rest, **kwargs)
        refuse_competing_arguments(self.args, getattr(self, "model_init", None))
        self._build_engine(zero3d_config, pretrained)

    # -- the engine --------------------------------------------------------------------

    def _build_engine(self, zero3d_config: Any, pretrained: str | None) -> None:
        config, self._scheduler_section = trainer_config(zero3d_config, self.args, self.model)
        self._refuse_layout(config)
        self._refuse_local_token_counts(config)
        if "loss_normalization" not in config and config.get("pipeline", {}).get("stages", 1) != 1 \
                and self.model_accepts_loss_kwargs:
            config["loss_normalization"] = "tokens"  # what the Trainer's num_items_in_batch does (module docstring)
        client_optimizer, client_scheduler = self.optimizer, self.lr_scheduler
        optimizer, groups = client_optimizer, None
        if optimizer is None and config.get("optimizer") is None:
            optimizer, groups = self._trainer_optimizer()
        self.engine, _, _, _ = parallel3d.initialize(model=self.model, config=config, model_parameters=groups,
                                                     optimizer=optimizer, lr_scheduler=client_scheduler,
                                                     pretrained=pretrained)
        self._client_scheduler = client_scheduler is not None
        self._refuse_other_world()
        self._refuse_pipeline_features()
        self.model_wrapped = EngineModel(self.engine)
        self.optimizer = EngineOptimizer(self.engine)
        self.lr_scheduler = EngineScheduler(self.engine)

    def _trainer_optimizer(self) -> tuple[Any, list[dict]]:
        """``args.optim`` (or ``optimizer_cls_and_kwargs``) over the Trainer's decay/no-decay groups, as a
        factory the engine calls over its fp32 master shards."""
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return (lambda inner_groups: cls(inner_groups, **kwargs)), [g for g in groups if g["params"]]

    @staticmethod
    def _refuse_layout(config: dict) -> None:
        cp = config.get("context_parallel", {}).get("size", 1)
        key = "context_parallel.size"
        if cp in (1, None) and config.get("sequence_parallel_size", 1) not in (1, None):
            cp, key = config["sequence_parallel_size"], "sequence_parallel_size"  # DeepSpeed's spelling (Ulysses)
        if cp not in (1, None):
            raise ConfigError(f"{key} {cp!r} with parallel3d.hf.Trainer: the Trainer's loss and its "
                              "token counts are per whole sequence, and context parallelism cuts sequences; train "
                              "it with engine.train_batch or `zero3d train`, or use context_parallel.size 1")

    def _refuse_local_token_counts(self, config: dict) -> None:
        """``average_tokens_across_devices=False`` hands ``compute_loss`` this rank's own label count,
        divided by ``get_tp_size()`` (tp x pp here). The engine's ``loss_normalization: "tokens"``
        takes the count as the global one (it multiplies by dp), and at tp > 1 the count is tp times
        too small: either way the loss and gradients would be dp or tp times the token mean. Pipeline
        stages count the tokens themselves (``train_batch``)."""
        tp = config.get("tensor_parallel", {}).get("size", 1) or 1
        stages = config.get("pipeline", {}).get("stages", 1) or 1
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        tokens = config.get("loss_normalization") == "tokens"
        if self.args.average_tokens_across_devices or stages != 1 or world == 1 or not (tokens or tp > 1):
            return
        what = 'loss_normalization "tokens"' if tokens else f"tensor_parallel.size {tp}"
        raise ConfigError(f"TrainingArguments(average_tokens_across_devices=False) with {what} in zero3d_config: the "
                          "Trainer would give each rank's own label count as the count of the whole step, and the "
                          "loss would be the data- or tensor-parallel size times the token mean; leave "
                          "average_tokens_across_devices at True (the default), or use loss_normalization "
                          '"micro_batch" at tensor_parallel.size 1')

    def _refuse_other_world(self) -> None:
        """accelerate (which the Trainer asks for the process count) must see the engine's ranks."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if self.accelerator.num_processes != world:
            raise ConfigError(f"the Trainer's accelerate state sees {self.accelerator.num_processes} process(es) and the "
                              f"process group has {world}: accelerate joins a torchrun group on a machine without "
                              "GPUs only with TrainingArguments(use_cpu=True)")

    def _refuse_pipeline_features(self) -> None:
        """With pipeline stages the model's own loss runs through the schedule: a loss the Trainer
        would compute differently cannot."""
        if self.engine.mesh.pp == 1:
            return
        if self.args.activation_checkpointing:
            raise ConfigError(f"pipeline.stages {self.engine.mesh.pp} with TrainingArguments(activation_checkpointing="
                              "True): the Trainer would wrap the layers of the HF model, which the pipeline has split; "
                              "set pipeline.activation_checkpointing: true in zero3d_config instead")
        own_loss = type(self).compute_loss is not transformers.Trainer.compute_loss
        if own_loss or self.compute_loss_func is not None or self.label_smoother is not None:
            what = ("compute_loss is overridden" if own_loss else "compute_loss_func is set" if
                    self.compute_loss_func is not None else "label_smoothing_factor is set")
            raise ConfigError(f"pipeline.stages {self.engine.mesh.pp} with parallel3d.hf.Trainer, and {what}: pipeline "
                              "stages train with the model's own loss, computed on the last stage inside the schedule; "
                              "use pipeline.stages 1 (ZeRO and tensor parallelism run the Trainer's loss) or the "
                              "model's own loss")

    # -- what transformers.Trainer asks ---------------------------------------------------

    def get_tp_size(self) -> int:
        """The ranks that see one batch (tp x pp): transformers divides its process count by this for
        the data-parallel size and for the factor of a token-normalized loss (module docstring)."""
        if self.engine is None:
            return super().get_tp_size()
        if self._tokens_factor_off:
            return self.accelerator.num_processes
        return self.accelerator.num_processes // self.engine.mesh.dp

    def _move_model_to_device(self, model, device) -> None:
        """The engine placed each rank's shard already (a meta model has nothing to move)."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.model_wrapped if self.engine is not None else model

    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        return shard_over_dp(loader, self.engine.mesh.dp, self.engine.mesh.local_rank("dp"),
                             self.accelerator.num_processes)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        engine = self.engine
        if engine.mesh.pp > 1 and hasattr(train_dataloader, "__len__") \
                and len(train_dataloader) % self.args.gradient_accumulation_steps:
            raise ConfigError(f"pipeline.stages {engine.mesh.pp}: an epoch of {len(train_dataloader)} micro-batches per "
                              f"rank is not a multiple of gradient_accumulation_steps "
                              f"{self.args.gradient_accumulation_steps}, and a pipeline runs whole windows; set "
                              "dataloader_drop_last or a dataset size that divides evenly")
        self._attach_schedule(max_steps)
        if resume_from_checkpoint is not None:
            engine.load_checkpoint(str(engine_dir(resume_from_checkpoint)))
        self.optimizer, self.lr_scheduler = EngineOptimizer(engine), EngineScheduler(engine)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        self._window = []
        return self.model_wrapped, train_dataloader

    def _attach_schedule(self, num_training_steps: int) -> None:
        """The engine's LR schedule for this ``train()``: the caller's, the config's, or ``args``'."""
        engine = self.engine
        if self._client_scheduler:
            return
        if self._scheduler_section is not None:
            section = scheduler_section(self._scheduler_section, self.args, num_training_steps)
            engine.lr_scheduler = build_lr_scheduler(engine.optimizer, section.type, section.typed_params())
            return
        self.lr_scheduler = None  # create_scheduler builds only where there is none
        engine.lr_scheduler = self.create_scheduler(num_training_steps, optimizer=engine.optimizer.inner)

    # -- a micro-batch ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _engine_counts_dp(self):
        """While the engine multiplies a token-mean loss by dp itself, the Trainer must not."""
        self._tokens_factor_off = self.engine.token_mean
        try:
            yield
        finally:
            self._tokens_factor_off = False

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.engine
        if engine.mesh.pp > 1:
            return self._pipeline_step(inputs)
        model.train()
        inputs = self._prepare_inputs(inputs)
        engine.set_gradient_accumulation_boundary(bool(self.accelerator.sync_gradients))
        with self.compute_loss_context_manager(), self._engine_counts_dp():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled_for_ga = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled_for_ga is None:
            scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled_for_ga and not engine.token_mean:
            loss = loss / self.current_gradient_accumulation_steps
        reported = engine.backward(loss, scale_wrt_gas=False)  # times dp under loss_normalization "tokens"
        self._note_step_lr()
        engine.step()  # at the window's end: reduce, clip, optimizer and LR schedule
        self._empty_cache_when_due()
        return reported.detach()

    def _pipeline_step(self, inputs) -> torch.Tensor:
        """Collect the window; at its last micro-batch run it through the pipeline schedule. The
        window's loss is reported there (the same on every rank), zero for the others."""
        self._window.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        window, self._window = self._window, []
        if len(window) != self.engine.gradient_accumulation_steps:
            raise UsageError(f"a pipeline window got {len(window)} micro-batches, and it runs exactly "
                             f"gradient_accumulation_steps {int(self.engine.gradient_accumulation_steps)}")
        self.engine.train()
        self._note_step_lr()
        loss = torch.tensor(self.engine.train_batch(iter(window)), device=self.args.device)
        self._empty_cache_when_due()
        return loss

    def _empty_cache_when_due(self) -> None:
        """``TrainingArguments.torch_empty_cache_steps``, as the Trainer's own training step honours it."""
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            clear_device_cache()

    def _note_step_lr(self) -> None:
        if self.accelerator.sync_gradients:
            self._step_lr = self.engine.get_lr()[0]

    def _get_learning_rate(self) -> float:
        """The Trainer logs the learning rate of the step it has just taken, read between the
        optimizer's and the schedule's step; the engine has stepped both by then, so the rate is
        noted before (read once: the loop asks once per step)."""
        lr, self._step_lr = self._step_lr, None
        return lr if lr is not None else super()._get_learning_rate()

    def _clip_grad_norm(self, model):
        """The engine clipped (config ``gradient_clipping``, from ``max_grad_norm``); its norm before clipping."""
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.get_global_grad_norm()

    # -- evaluation ---------------------------------------------------------------------------

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """The Trainer's loop, its results gathered over data-parallel ranks only (the loop resets
        ``gather_function`` to accelerate's at its end, so it is set for each call)."""
        self.gather_function = functools.partial(gather_over_dp, group=self.engine.mesh.dp_group,
                                                 state=self.accelerator.gradient_state,
                                                 use_gather_object=self.args.eval_use_gather_object)
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's (or a subclass's) step through the engine; with pipeline stages the loss of
        ``eval_batch``, the same on every rank."""
        mesh = self.engine.mesh
        if not prediction_loss_only and (mesh.pp > 1 or mesh.tp > 1):
            raise ConfigError(f"evaluation asked for logits (compute_metrics or prediction_loss_only=False) at "
                              f"pipeline.stages {mesh.pp}, tensor_parallel.size {mesh.tp}: logits are whole only "
                              "without tensor or pipeline parallelism (the vocabulary is split over tp, and only "
                              "the last stage computes them); evaluate the loss alone there")
        if mesh.pp == 1:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        if inputs.get("labels") is None:
            raise ConfigError("evaluation with pipeline stages needs labels in each batch (eval_batch returns the loss)")
        return torch.tensor(self.engine.eval_batch(iter([inputs]), num_micro_batches=1), device=self.args.device), \
            None, None

    def generate(self, *args: Any, **kwargs: Any):
        """``model.generate`` with every parameter gathered (collective over dp: every rank calls it).

        Where the layout allows: without tensor or pipeline parallelism. At ZeRO stage 3 the whole
        model is gathered for the call, so it must fit on one device.

        With more than one rank the ranks generate in step (``synced_gpus``, as transformers does
        under DeepSpeed ZeRO-3): a rank whose sequences are done keeps running forwards until every
        rank's are. A forward can be a collective: the all-to-all of each expert-parallel MoE layer,
        and at ZeRO stage 3 the first forward's check that the ranks run the same blocks. A rank
        that stopped early would leave its peers waiting in it."""
        mesh = self.engine.mesh
        if mesh.pp > 1 or mesh.tp > 1:
            raise ConfigError(f"Trainer.generate at pipeline.stages {mesh.pp}, tensor_parallel.size {mesh.tp}: "
                              "generation runs the whole model on each rank, so only without tensor or pipeline "
                              "parallelism; save_model() and generate from the saved directory instead")
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            if kwargs.get("synced_gpus") is False:
                raise ConfigError("Trainer.generate(synced_gpus=False) on more than one rank: a forward can be a "
                                  "collective (expert parallelism's all-to-all, ZeRO stage 3's first-forward check), "
                                  "so a rank that stops early would leave the others waiting; leave synced_gpus out")
            kwargs["synced_gpus"] = True
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), GatheredParameters(list(module.parameters())):
                return module.generate(*args, **kwargs)
        finally:
            module.train(was_training)

    # -- saving and resuming ------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained`` directory (collective); inside a ``checkpoint-N`` the engine's checkpoint."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        if _internal_call:
            self.engine.save_checkpoint(str(engine_dir(output_dir)))
        else:
            export_model(self.engine, output_dir, self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """In the engine's checkpoint (``save_model(..., _internal_call=True)``)."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Checked here; loaded by the engine once ``train()`` has attached the LR schedule."""
        if not engine_dir(resume_from_checkpoint).is_dir():
            raise ConfigError(f"resume_from_checkpoint={resume_from_checkpoint!r} has no {engine_dir('').name}/ "
                              "directory: it was not written by parallel3d.hf.Trainer (a checkpoint of another "
                              "Trainer cannot resume a Zero3D engine; start from its model with model=DIR)")

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """The engine's checkpoint holds them (loaded in ``_prepare_for_training``)."""

    def _load_best_model(self) -> None:
        self.engine.load_checkpoint(str(engine_dir(self.state.best_model_checkpoint)), load_module_only=True)


class Trainer(Zero3DTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with ``zero3d_config=``: trains through ``parallel3d.initialize``.

    ``model`` may be a model or the path of a local Hugging Face directory (started on the meta
    device; each rank reads only its slices). Every other argument is the Trainer's. See
    docs/hf_trainer.md.
    """
