"""The anatomy of a Hugging Face causal LM that the parallel engines need."""

from __future__ import annotations

from torch import nn

from models.families import family_record


def fetch_unit_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (outermost first, in registration order).

    HF models name their block class in ``_no_split_modules`` (``LlamaDecoderLayer``,
    ``GPT2Block``...), unless their family record names it (:mod:`models.families`); those are
    the ZeRO-3 fetch units. A model that names none (BERT-style and encoder-decoder families,
    plain ``nn.Module`` s) gets the members of its ``nn.ModuleList`` s of one class (the layers
    it loops over); a model without those gets no blocks. A named module holding a parameter
    that a module outside it also uses (BERT's embeddings, tied to the head) is no block:
    released after its forward, it would be missing at the other use; it stays with the root
    units. So does everything outside the blocks: a module whose forward its parent runs past
    the module hooks (ProphetNet calls ``position_embeddings._forward``) is then gathered.
    """
    names = family_record(getattr(model, "config", None)).block_names(model)
    if names:
        candidates = [m for m in model.modules() if type(m).__name__ in names]
    else:
        candidates = [layer for m in model.modules() if _is_layer_list(m) for layer in m]
    users: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), set()).add(id(module))
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in candidates:
        if id(module) in inside:
            continue
        members = {id(m) for m in module.modules()}
        if any(users[id(p)] - members for p in module.parameters()):
            continue
        blocks.append(module)
        inside |= members
    return blocks


def text_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the text path: those inside the module that holds the input embedding (a
    multimodal model's language model, not its vision tower, whose blocks text training never
    runs); all blocks when the embedding sits outside every block container."""
    blocks = fetch_unit_modules(model)
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    names = {id(m): n for n, m in model.named_modules()}
    parent = names.get(id(emb), "").rpartition(".")[0] if emb is not None else ""
    inside = [b for b in blocks if names[id(b)].startswith(parent + ".")] if parent else []
    return inside or blocks


def _is_layer_list(module: nn.Module) -> bool:
    """A ModuleList of two or more modules of one class, each holding parameters: a model's layers."""
    return (isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1
            and all(next(m.parameters(), None) is not None for m in module))


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
