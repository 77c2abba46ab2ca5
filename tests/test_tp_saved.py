"""Sequence parallelism saves no more activations for backward than plain tensor parallelism.

A split region (attention, MLP) all-gathers the sequence once and hands it to all its column
layers (q, k, v; gate, up). If that gathered tensor is a non-contiguous view (a gather along
the sequence dim of a [batch, seq, hidden] tensor is one, unless it is made contiguous),
every ``F.linear`` reshapes it into its own contiguous copy and saves that for backward:
three copies of the full sequence per attention and two per MLP (model A: +36 MiB peak RSS
at tp 2, found by ``scripts/bench_tp_peers.py``). Counted here: the bytes of the distinct
storages autograd saves during one forward, with and without sequence parallelism.
"""

from __future__ import annotations

import torch

from tests.tiny_tp import make_tp_model, tp_batch, tp_group


def saved_bytes(sequence_parallel: bool) -> int:
    from parallel3d.tensor_parallel import apply_tensor_parallel

    model = make_tp_model("llama")
    apply_tensor_parallel(model, tp_group(2), sequence_parallel=sequence_parallel)
    batch = tp_batch(model.config.vocab_size)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    return sum(storages.values())


def both() -> tuple[int, int]:
    return saved_bytes(False), saved_bytes(True)


def test_sequence_parallel_saves_no_more(dist):
    for plain, sp in dist.run(2, both):
        assert sp <= plain, f"sequence parallel saves {sp} bytes for backward, plain tp {plain}"
