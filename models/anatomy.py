"""The anatomy of a Hugging Face causal LM that the parallel engines need."""

from __future__ import annotations

from torch import nn

from models.families import family_record


def fetch_unit_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (outermost first, in registration order).

    HF models name their block class in ``_no_split_modules`` (``LlamaDecoderLayer``,
    ``GPT2Block``...), unless their family record names it (:mod:`models.families`); those are
    the ZeRO-3 fetch units. A model without either gets no blocks, and ZeRO-3 then gathers all
    of its parameters as one root unit. A named module holding a parameter that a module outside
    it also uses (BERT's embeddings, tied to the head) is no block: released after its forward,
    it would be missing at the other use; it stays with the root units.
    """
    names = family_record(getattr(model, "config", None)).block_names(model)
    users: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), set()).add(id(module))
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or type(module).__name__ not in names:
            continue
        members = {id(m) for m in module.modules()}
        if any(users[id(p)] - members for p in module.parameters()):
            continue
        blocks.append(module)
        inside |= members
    return blocks


def tied_parameter_names(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias another parameter: ``{alias: owner}``."""
    seen: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return tied
