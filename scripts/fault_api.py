"""Training scripts of the fault probe's Python API cases, run on 2 ranks under ``zero3d launch``.

    zero3d launch --nproc-per-node 2 scripts/fault_api.py bad-ids TP FORM
        one good step, then a micro-batch holding token id == vocab_size on rank 1 only (FORM:
        dict, tuple); the ConfigError ends the script as a user's script ends; rank 0 first
        prints whether the engine's parameters and step count are unchanged.
    zero3d launch --nproc-per-node 2 scripts/fault_api.py save-forever DIR
        a step and a checkpoint into DIR, back to back, until killed; rank 0 prints "saved N".
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parallel3d  # noqa: E402
from parallel3d.errors import ConfigError  # noqa: E402
from tests.tiny import ds_config, make_model  # noqa: E402
from tests.tiny_tp import make_tp_model  # noqa: E402

VOCAB = 127  # tests.tiny_tp's llama


def _batch(bad: bool, form: str):
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    if bad:
        ids[1, 5] = VOCAB
    if form == "tuple":  # LlamaForCausalLM.forward's positional parameters, labels sixth
        return (ids, None, None, None, None, ids.clone())
    return {"input_ids": ids, "labels": ids.clone()}


def bad_ids(tp: int, form: str) -> None:
    cfg = ds_config(2, 1, 2 // tp)
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp}
    engine, _, _, _ = parallel3d.initialize(model=make_tp_model("llama"), config=cfg)
    engine.train_batch(iter([_batch(False, form)]))
    before, steps = {k: v.clone() for k, v in engine.full_parameters().items()}, engine.global_steps
    try:
        engine.train_batch(iter([_batch(dist.get_rank() == 1, form)]))
    except ConfigError:
        after = engine.full_parameters()
        same = engine.global_steps == steps and all(torch.equal(before[k], after[k]) for k in before)
        if dist.get_rank() == 0:
            print(f"engine unchanged: {same}", flush=True)
        raise


def save_forever(directory: str) -> None:
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=4), config=ds_config(2, 1, 2))
    ids = torch.arange(16)[None]
    for _ in range(100000):
        engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
        engine.save_checkpoint(directory)
        if dist.get_rank() == 0:
            print("saved", engine.global_steps, flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "bad-ids":
        bad_ids(int(args[0]), args[1])
    elif command == "save-forever":
        save_forever(args[0])
    else:
        raise SystemExit(f"fault_api.py: unknown command {command!r} (bad-ids, save-forever)")
