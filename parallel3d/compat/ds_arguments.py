"""``deepspeed.initialize``'s keyword arguments, read by ``parallel3d.initialize``.

So that a script moves over by changing its import, ``initialize`` takes DeepSpeed's argument
names too: ``args`` (an argparse namespace whose ``deepspeed_config``, or the old
``deepscale_config``, names the config file),
``config_params`` (the old name of ``config``), ``dist_init_required`` and
``distributed_port``. ``mpu`` and ``mesh_param`` (DeepSpeed's hooks for a model-parallel
layout the script built itself) are refused: Zero3D builds its pp x dp x tp mesh from the
config's ``tensor_parallel.size`` and ``pipeline.stages``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch.distributed as dist
from torch import nn

from parallel3d.errors import ConfigError, NoModelError


def check_model(model: Any) -> None:
    """``model`` must be a module (NoModelError, an AssertionError as DeepSpeed's, otherwise)."""
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, argparse.Namespace):  # deepspeed.initialize(args, model, ...): its first is args
            hint = ("; initialize's first positional argument is the model (DeepSpeed's is args): pass args=... "
                    "and model=... by keyword")
        raise NoModelError(f"model must be a torch.nn.Module, got {type(model).__name__}{hint}")


def resolve_config(config: Any, config_params: Any, args: Any) -> Any:
    """The config source among ``config``, ``config_params`` and ``args.deepspeed_config`` (exactly one)."""
    from_args = [(f"args.{name}", getattr(args, name, None)) for name in ("deepspeed_config", "deepscale_config")]
    given = {name: value for name, value in (("config", config), ("config_params", config_params), *from_args)
             if value is not None}
    if len(given) > 1:
        raise ConfigError(f"the config was given twice ({' and '.join(given)}); give it once, as config=")
    if not given:
        raise ConfigError("no config: pass config= (a DeepSpeed JSON/YAML path or a dict), or args with a "
                          "deepspeed_config attribute as deepspeed.initialize reads it")
    return next(iter(given.values()))


def check_distributed_arguments(mpu: Any, mesh_param: Any, dist_init_required: bool | None,
                                distributed_port: Any) -> None:
    """Refuse DeepSpeed's model-parallel hooks; check ``dist_init_required`` and ``distributed_port``."""
    if mpu is not None:
        raise ConfigError("mpu= is not supported: Zero3D builds its tensor- and pipeline-parallel groups itself "
                          "from tensor_parallel.size and pipeline.stages in the config; pass no mpu")
    if mesh_param is not None:
        raise ConfigError("mesh_param= is not supported: Zero3D's mesh is pp x dp x tp from pipeline.stages and "
                          "tensor_parallel.size in the config; pass no mesh_param")
    if dist_init_required is not None and not isinstance(dist_init_required, bool):
        raise ConfigError(f"dist_init_required must be None, True or False, got {dist_init_required!r}")
    if dist_init_required is False and not dist.is_initialized():
        raise ConfigError("dist_init_required=False but torch.distributed is not initialized: initialize the "
                          "process group first, or leave dist_init_required unset (initialize joins torchrun's)")
    if distributed_port is not None and (isinstance(distributed_port, bool) or not isinstance(distributed_port, int)):
        raise ConfigError(f"distributed_port must be an int, got {distributed_port!r} (Zero3D joins the process "
                          "group from torchrun's MASTER_ADDR/MASTER_PORT; the port is not used otherwise)")


def deepspeed_partitioned(model: nn.Module) -> list[str]:
    """Names of parameters that ``deepspeed.zero.Init`` partitioned (DeepSpeed sets their ``ds_id``)."""
    return [name for name, p in model.named_parameters() if "ds_id" in vars(p)]


def refuse_deepspeed_partitioned(model: nn.Module) -> None:
    """A model built under ``deepspeed.zero.Init`` holds empty shards Zero3D cannot train: say what to do."""
    names = deepspeed_partitioned(model)
    if names:
        raise ConfigError(
            f"{len(names)} parameters of the model ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) "
            "were partitioned by deepspeed.zero.Init: each rank holds an empty DeepSpeed shard that Zero3D cannot "
            "train. Build the model without deepspeed.zero.Init; for a model too big for one rank, build it on the "
            "meta device (with torch.device('meta'): model = ...) and Zero3D materializes only each rank's share")
