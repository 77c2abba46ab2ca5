"""``zero3d export`` of a PEFT model's checkpoint: an adapter directory, or the base with adapters merged.

A checkpoint of a PEFT model holds the trained parameters (the adapters) under the names of
the HF model inside the ``PeftModel`` and, in its manifest, each adapter's config
(``checkpoint.json``'s ``peft``: parallel3d/build/peft_model.py); the frozen base is not in it. So:

* by default the export is what ``PeftModel.save_pretrained`` writes: ``adapter_config.json``
  and ``adapter_model.safetensors`` whose keys are ``peft``'s (``base_model.model.`` + the HF
  name without the adapter's name), the default adapter at OUT and any other in OUT/<name>, as
  ``peft`` lays out several adapters; ``PeftModel.from_pretrained(base, OUT)`` loads it.
* with ``--merged --base DIR`` the base is read from DIR (a ``from_pretrained`` directory),
  the adapters loaded into it by ``peft`` and merged (``merge_and_unload``), and the result
  saved as a plain HF directory. This builds the whole model in host memory once, unlike the
  streaming export of a full checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_key(name: str, adapter: str) -> str:
    """``peft``'s key in an adapter file for the HF model's parameter ``name`` of ``adapter``: the
    adapter's name left out, and a ``modules_to_save`` copy saved under the module's own name (as
    ``peft.get_peft_model_state_dict`` writes them)."""
    name = name.replace(f".modules_to_save.{adapter}.", ".")
    return "base_model.model." + name.replace(f".{adapter}.", ".")


def adapter_names(names: list[str], adapters: list[str]) -> dict[str, list[str]]:
    """The checkpoint's parameter names of each adapter; trained names of no adapter (a bias that
    ``bias: all`` trains) go with the first adapter."""
    out: dict[str, list[str]] = {a: [] for a in adapters}
    for name in names:
        owner = next((a for a in adapters if f".{a}." in name), adapters[0])
        out[owner].append(name)
    return out


def write_adapters(tmp: Path, adapters: dict[str, dict], names: list[str], write) -> int:
    """Write each adapter's config and weights under ``tmp`` (default adapter at the top);
    ``write(path, [(name, key)])`` writes one safetensors file. Returns the tensors written."""
    count = 0
    for adapter, owned in adapter_names(names, list(adapters)).items():
        where = tmp if adapter == "default" or len(adapters) == 1 else tmp / adapter
        where.mkdir(parents=True, exist_ok=True)
        (where / ADAPTER_CONFIG).write_text(json.dumps(adapters[adapter], indent=2, sort_keys=True) + "\n")
        write(where / ADAPTER_WEIGHTS, [(n, adapter_key(n, adapter)) for n in owned])
        count += len(owned)
        logger.info("wrote adapter %r (%d tensors) to %s", adapter, len(owned), where)
    return count


def merge_into_base(adapter_dir: Path, base: str, tmp: Path, dtype: torch.dtype, max_shard_size: int,
                    trust_remote_code: bool) -> None:
    """Load the base from ``base``, merge the adapters of ``adapter_dir`` into it with ``peft``
    and save the merged model under ``tmp`` in ``dtype``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not Path(base).is_dir():
        raise ConfigError(f"--base {base} is not a directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"--base {base}: not a from_pretrained directory of a causal LM: {exc}") from exc
    adapters = [p.parent for p in sorted(adapter_dir.rglob(ADAPTER_CONFIG))]
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name=_name(adapters[0], adapter_dir))
    for extra in adapters[1:]:
        model.load_adapter(extra, adapter_name=_name(extra, adapter_dir))
    merged = model.merge_and_unload(adapter_names=[_name(a, adapter_dir) for a in adapters])
    merged.to(dtype).save_pretrained(tmp, max_shard_size=max_shard_size)


def _name(path: Path, top: Path) -> str:
    return "default" if path == top else path.name


def scratch_dir(near: Path) -> Path:
    """A temporary directory beside ``near`` (the adapters on their way to a merge)."""
    return Path(tempfile.mkdtemp(prefix=f".{near.name}.adapters", dir=near.parent))


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
