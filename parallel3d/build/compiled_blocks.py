"""Compiled blocks: ``torch.compile`` on each repeated block's forward (config section ``compile``).

Regional compilation, as torchtitan's ``apply_compile``: every decoder layer is compiled on its
own rather than the whole model, so one graph serves all the layers (they share their forward's
code and their guards) and compile time does not grow with depth. What is compiled is the
block's ``forward``, put in the module's ``__dict__``; ``nn.Module.__call__`` still runs the
module's hooks eagerly around it. That keeps out of the compiled code everything that acts on
the block from outside:

* ZeRO-3's gather (forward pre-hook), release (forward hook) and the backward hooks the release
  puts on the block's outputs (zero/stage3.py): the parameters are whole whenever the compiled
  forward runs, and the graph reads them as inputs, so a gather into new memory is no recompile;
* the pipeline's and sequence parallelism's hooks on a stage's first and last block;
* gradient readiness (``register_post_accumulate_grad_hook`` on the parameters).

Inside a block the compiled code holds tensor parallelism's collectives, which dynamo traces as
functional collectives (parallel3d/tensor_parallel/comm.py is traced as written), and the
``copy_to_tp`` hooks on the split regions. Tensor parallelism's dropout streams
(parallel3d/tensor_parallel/rng.py) swap the generator state in hooks on modules inside the
blocks, which dynamo cannot trace (a graph break at every region): with ``compile`` and
``tensor_parallel.size > 1`` the blocks must draw no random numbers (every dropout probability
0, as in Llama-family models), and the streams are switched off.

Training calls of the whole model (``engine(...)``) get ``use_cache=False`` where the caller does
not say: a key/value cache filled in training is never read, and each layer's cache entry
would be a guard of its own (a recompilation per layer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from models import fetch_unit_modules
from pydantic import ValidationError

from parallel3d.config.sections import CompileConfig, describe_validation_error
from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

_REFUSED_BACKENDS = {"cudagraphs": "records CUDA graphs, which replay fixed memory addresses (see compile.kwargs.mode)"}


def check_backend(backend: str | Callable) -> None:
    """A backend name ``torch.compile`` knows (or a callable, from ``engine.compile``)."""
    if callable(backend):
        return
    import torch._dynamo

    known = [b for b in torch._dynamo.list_backends(exclude_tags=())  # "debug" ones too: aot_eager, eager
             if b not in _REFUSED_BACKENDS and "TESTING" not in b and "minifier" not in b]
    if backend in _REFUSED_BACKENDS:
        raise ConfigError(f'compile.backend: "{backend}" {_REFUSED_BACKENDS[backend]}; allowed: {", ".join(known)}')
    if backend not in known:
        raise ConfigError(f'compile.backend: "{backend}" is not a torch.compile backend; allowed: {", ".join(known)}')


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """``engine.compile(compile_kwargs=...)``: the keywords the config's ``compile.kwargs`` allows."""
    try:
        CompileConfig(kwargs=kwargs)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, CompileConfig, "compile")) from None


def random_draws(blocks: Sequence[nn.Module]) -> list[str]:
    """Where ``blocks`` draw random numbers in training: dropout modules with ``p > 0`` and float
    attributes named ``*dropout*`` above 0 (an attention's ``attention_dropout``, handed to
    ``scaled_dot_product_attention``). Names are the module classes'."""
    found = []
    for block in blocks:
        for module in block.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                found.append(f"{type(module).__name__}(p={module.p})")
            for name, value in vars(module).items():
                if "dropout" in name and isinstance(value, float) and value > 0:
                    found.append(f"{type(module).__name__}.{name}={value}")
    return sorted(set(found))


def check_layout(model: nn.Module, tensor_parallel_size: int, context_parallel_size: int,
                 expert_parallel_size: int = 1) -> None:
    """Before any process group: with tensor parallelism the blocks must not drop out (see the
    module); context and expert parallelism are refused."""
    _refuse_context_parallel(context_parallel_size)
    _refuse_expert_parallel(expert_parallel_size)
    blocks = fetch_unit_modules(model)
    if not blocks:
        raise ConfigError(f"compile.enabled: {type(model).__name__} has no repeated blocks to compile (no "
                          "_no_split_modules class and no list of layers of one class)")
    _refuse_dropout(blocks, tensor_parallel_size)


def _refuse_context_parallel(context_parallel_size: int) -> None:
    if context_parallel_size > 1:
        raise ConfigError(
            f"compile.enabled with context_parallel.size {context_parallel_size} is not supported yet: the Ulysses "
            "attention counts its calls in Python (the check that every layer ran it), which torch.compile turns into "
            "one guard per layer (a recompilation for each block); turn compile off or use context_parallel.size 1")


def _refuse_expert_parallel(expert_parallel_size: int) -> None:
    if expert_parallel_size > 1:
        raise ConfigError(
            f"compile.enabled with expert_parallel.autoep_size {expert_parallel_size} is not supported yet: the "
            "all-to-all that sends tokens to their experts' ranks is sized by the routing (data-dependent shapes "
            "inside every MoE block), which Zero3D has not compiled and tested (DeepSpeed keeps these layers eager: "
            "compile.autoep_non_moe); turn compile off or expert parallelism off")


def _refuse_dropout(blocks: Sequence[nn.Module], tensor_parallel_size: int) -> None:
    if tensor_parallel_size == 1:
        return
    draws = random_draws(blocks)
    if draws:
        raise ConfigError(
            f"compile.enabled with tensor_parallel.size {tensor_parallel_size}: the model's blocks use dropout "
            f"({', '.join(draws[:4])}), whose per-rank random streams under tensor parallelism are switched in module "
            "hooks that torch.compile cannot trace (a graph break in every block); set the model's dropout "
            "probabilities to 0 (config attention_dropout / hidden_dropout / resid_pdrop ...), or turn compile off")


class CompiledBlocks:
    """The blocks whose forward was replaced by a compiled one; ``undo`` restores them."""

    def __init__(self, blocks: Sequence[nn.Module], backend: str | Callable, kwargs: dict[str, Any]) -> None:
        self.blocks = list(blocks)
        self.backend = backend
        self.kwargs = dict(kwargs)
        for block in self.blocks:
            block.forward = torch.compile(block.forward, backend=backend, **kwargs)
        logger.info("compiled %d blocks with torch.compile(backend=%s, %s)", len(self.blocks), backend, kwargs)

    def undo(self) -> None:
        for block in self.blocks:
            block.__dict__.pop("forward", None)
        self.blocks = []


def compile_blocks(model: nn.Module, pipe: nn.Module | None, tp_info: Any, backend: str | Callable,
                   kwargs: dict[str, Any], context_parallel_size: int = 1, expert_parallel_size: int = 1) -> CompiledBlocks:
    """Compile this rank's blocks: the model's repeated blocks, or its pipeline chunks' layers.

    Tensor parallelism's dropout streams are switched off (the blocks draw nothing, or this refuses)."""
    blocks = [layer for chunk in pipe.chunks for layer in chunk.layers] if pipe is not None else fetch_unit_modules(model)
    _refuse_context_parallel(context_parallel_size)
    _refuse_expert_parallel(expert_parallel_size)
    _refuse_dropout(blocks, tp_info.tp_size if tp_info is not None else 1)
    if not blocks and pipe is None:
        raise ConfigError(f"compile.enabled: {type(model).__name__} has no repeated blocks to compile (no "
                          "_no_split_modules class and no list of layers of one class)")
    if tp_info is not None:
        tp_info.rng.active = False
    return CompiledBlocks(blocks, backend, kwargs)


def compile_counts() -> dict[str, int]:
    """Process-wide counts from dynamo: frames compiled (the first compile of each distinct block
    and every recompilation), graphs made, and graph breaks. A training loop whose counts stop
    moving after its first steps recompiles nothing."""
    from torch._dynamo.utils import counters

    return {"frames_compiled": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}

