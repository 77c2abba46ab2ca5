"""A PEFT model built on the meta device: the base from ``pretrained=`` (or its eager
construction), the adapters as ``peft`` draws them.

``with torch.device("meta"): base = AutoModelForCausalLM.from_config(cfg)``, then
``get_peft_model(base, LoraConfig(...))`` gives LoRA layers whose base and adapters have no
values. The base's values come from where a plain meta model's would (the safetensors
directory of ``pretrained=``, each rank reading its slices, or :class:`models.materialize.
InitReplay` of the model the class builds from the config), under the names ``peft`` gave them
(``q_proj.base_layer.weight`` is the checkpoint's ``q_proj.weight``). The adapters are small:
every rank draws them whole, as ``get_peft_model`` does on a real base (``nn.Linear``'s own
init of ``lora_A`` and ``lora_B``, then ``reset_lora_parameters`` with the adapter's
``init_lora_weights``, layer by layer in module order) from the CPU generator as it stands
when ``initialize`` is called, which is then restored: a base built eagerly with the same seed
and wrapped by ``get_peft_model`` under the same generator state gets the same adapters.
Initializations that read the base weights (PiSSA, OLoRA, LoftQ, EVA, CorDA) are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from models.tensor_source import Rect, normalize_rect
from parallel3d.errors import ConfigError

_DRAWN_INITS = (True, False, "gaussian")


def has_adapters(model: nn.Module) -> bool:
    """Whether ``peft`` has injected LoRA layers into ``model``."""
    return any(_is_lora(m) for m in model.modules())


def _is_lora(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "reset_lora_parameters")


def plain_model(model: nn.Module) -> nn.Module:
    """The model ``type(model)`` builds from its config on the meta device: no adapters."""
    with torch.device("meta"):
        return type(model)(copy.deepcopy(model.config))


def base_names(model: nn.Module) -> dict[str, str]:
    """``{name in model: name in the plain model}`` for every parameter ``peft`` moved into a base layer."""
    return {n: n.replace(".base_layer.", ".") for n, _ in model.named_parameters() if ".base_layer." in n}


def draw_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter parameter of the meta ``model``, whole, drawn as ``get_peft_model`` draws it."""
    configs = getattr(model, "peft_config", {})
    state = torch.random.get_rng_state()
    values: dict[str, torch.Tensor] = {}
    try:
        for name, layer in model.named_modules():
            if not _is_lora(layer):
                continue
            for adapter in list(layer.lora_A):
                init = getattr(configs.get(adapter), "init_lora_weights", True)
                if init not in _DRAWN_INITS:
                    raise ConfigError(f"LoRA adapter {adapter!r}: init_lora_weights={init!r} computes the adapters "
                                      "from the base weights, which a meta-device model does not have yet; build the "
                                      "model eagerly (from_pretrained) or use init_lora_weights true, false or "
                                      "\"gaussian\"")
                values.update(_draw(name, layer, adapter, init))
    finally:
        torch.random.set_rng_state(state)
    return values


def _draw(name: str, layer: nn.Module, adapter: str, init) -> dict[str, torch.Tensor]:
    meta = (layer.lora_A[adapter], layer.lora_B[adapter])
    real = [copy.deepcopy(m).to_empty(device="cpu") for m in meta]
    try:
        layer.lora_A[adapter], layer.lora_B[adapter] = real
        for m in real:
            m.reset_parameters()  # the draws of their construction
        layer.reset_lora_parameters(adapter, init)
    finally:
        layer.lora_A[adapter], layer.lora_B[adapter] = meta
    out = {}
    for side, module in zip(("lora_A", "lora_B"), real):
        out.update({f"{name}.{side}.{adapter}.{p}": t.detach() for p, t in module.named_parameters()})
    return out


class AdapterSource:
    """A tensor source (``models.tensor_source``) for a PEFT model: base parameters from ``base``
    (a source of the plain model) under their ``peft`` names, adapters from ``adapters``."""

    def __init__(self, base, renames: Mapping[str, str], adapters: Mapping[str, torch.Tensor]) -> None:
        self.base = base
        self.renames = dict(renames)
        self.adapters = dict(adapters)
        moved = set(self.renames.values())
        self._names = [n for n in base.names() if n not in moved] + list(self.renames) + list(self.adapters)

    def names(self) -> list[str]:
        return list(self._names)

    def aliases(self) -> dict[str, str]:
        return getattr(self.base, "aliases", lambda: {})()

    def read(self, requests: Mapping[str, Sequence[Rect]]) -> Iterator[tuple[str, list[torch.Tensor]]]:
        mine = {n: rects for n, rects in requests.items() if n in self.adapters}
        for name, rects in mine.items():
            value = self.adapters[name]
            yield name, [value[normalize_rect(name, value.shape, r)].clone() for r in rects]
        back = {self.renames.get(n, n): n for n in requests if n not in mine}
        for name, tensors in self.base.read({b: requests[n] for b, n in back.items()}):
            yield back[name], tensors

    def fill(self, destinations: Mapping[str, Sequence[tuple[Rect, torch.Tensor]]]) -> None:
        for name, items in destinations.items():
            if name in self.adapters:
                value = self.adapters[name]
                for rect, dest in items:
                    dest.copy_(value[normalize_rect(name, value.shape, rect)])
        self.base.fill({self.renames.get(n, n): items for n, items in destinations.items() if n not in self.adapters})

    def __getattr__(self, attr: str):
        return getattr(self.base, attr)  # buffers, buffer_names: the plain model's, under the same names
