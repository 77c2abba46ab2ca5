"""Context parallelism registers its attention (which holds the cp process group) in transformers'
process-wide registry; the entry must go with the model, so that no engine leaves its group behind."""

from __future__ import annotations

import gc

from tests.tiny import ds_config, make_model


def _registered_after_two_engines() -> tuple[int, int]:
    import parallel3d
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def ours() -> set[str]:
        return {k for k in ALL_ATTENTION_FUNCTIONS._global_mapping if k.startswith("zero3d_")}

    before, during = ours(), 0
    for method in ("ring", "ulysses"):
        config = ds_config(1, 1, 1)
        config["context_parallel"] = {"size": 2, "method": method}
        engine = parallel3d.initialize(model=make_model("llama"), config=config)[0]
        during = max(during, len(ours() - before))
        del engine
        gc.collect()
    return during, len(ours() - before)


def test_no_engine_leaves_its_group_in_transformers_registry(dist):
    for during, after in dist.run(2, _registered_after_two_engines):
        assert during == 1  # registered while the engine lives
        assert after == 0
