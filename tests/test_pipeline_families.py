"""Pipeline stages for the families beyond Llama, Qwen2, GPT-NeoX and GPT-2 (pp = 2, 1F1B and
interleaved 1F1B) against the single-process model, and the families that are refused. The
families whose configs ship no plan (Falcon in three layouts, GPT-BigCode, OPT, BLOOM, GPT-J,
CodeGen, StableLM) split by the plans of their records (models/families.py).

Each rank trains the same tiny model a few steps with plain SGD in one process (the oracle)
and through the pipeline executor, then compares every step's loss and the update of every
parameter it holds: SGD turns a wrong gradient into a wrong parameter, where a loss alone can
hide it (a gradient that never reaches a norm weight, say). The models run in float64: a tied
embedding's two gradient halves are summed in another order than autograd sums them, and in
float32 that rounding difference grows over a few SGD steps to the size of the tolerance;
in float64 any difference above it is a bug. Micro-batches carry right padding and ignored
labels, so masks and token counts differ between them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from parallel3d.errors import ConfigError
from tests.tiny_pp import accumulate, make_pp_model, pp_group, rel_error
from tests.tiny_pp_families import SPECS, make_family_model, sgd_train

RTOL = 1e-5
SCHEDULES = ("1f1b", "interleaved_1f1b")


def train_family(kind: str) -> dict:
    """On every rank: each schedule's losses and parameter updates against the oracle's."""
    import torch.distributed as dist

    from parallel3d.pipeline.executor import PipelineExecutor
    from parallel3d.pipeline.stage import split_model

    group = pp_group(2)
    rank = dist.get_rank(group)
    start = make_family_model(kind).double()
    before = {n: p.detach().clone() for n, p in start.named_parameters(remove_duplicate=False)}
    oracle = copy.deepcopy(start)
    out: dict = {"want": sgd_train(oracle.parameters(), lambda batches: accumulate(oracle, batches))}
    after = {n: p.detach().clone() for n, p in oracle.named_parameters(remove_duplicate=False)}
    for schedule in SCHEDULES:
        pipe = split_model(copy.deepcopy(start), 2, rank, virtual_stages=2 if schedule == "interleaved_1f1b" else 1)
        executor = PipelineExecutor(pipe, group, schedule)
        losses = sgd_train(pipe.parameters(), lambda batches: executor.run(batches).item())
        errors = {name: rel_error(p.detach() - before[name], after[name] - before[name])
                  for name, p in pipe.hf_named_parameters()}
        out[schedule] = {"losses": losses, "errors": errors}
    return out


@pytest.mark.parametrize("kind", [k for k in SPECS if k != "mixtral_aux"])  # refused: its router's loss
def test_family_matches_single_process(dist, kind):
    results = dist.run(2, train_family, kind)
    model = make_family_model(kind)
    every_name = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for schedule in SCHEDULES:
        seen: set[str] = set()
        for rank, r in enumerate(results):
            got = r[schedule]
            assert got["losses"] == pytest.approx(r["want"], rel=RTOL), f"{schedule} rank {rank} losses"
            worst = max(got["errors"], key=got["errors"].get)
            assert got["errors"][worst] < RTOL, f"{schedule} rank {rank}: {worst} off by {got['errors'][worst]:.2e}"
            seen.update(got["errors"])
        assert {n for n, _ in model.named_parameters()} <= seen <= every_name, f"{schedule}: {seen ^ every_name}"


def _refusal(model_type: str, **overrides) -> str:
    from parallel3d.pipeline.stage import split_model

    with pytest.raises(ConfigError) as info:
        split_model(make_family_model(model_type, **overrides), 2, 0)
    return str(info.value)


def test_router_auxiliary_loss_is_refused():
    message = _refusal("mixtral", output_router_logits=True)
    assert message == (
        "pipeline parallelism does not support MixtralForCausalLM (model_type='mixtral'): MixtralForCausalLM.forward "
        "adds a term to the loss when `output_router_logits` (true for this config); pipeline stages compute only the "
        "token loss")


# ---------------------------------------------------------------------------------------------
# base forwards the pipeline cannot cut (Llama with one thing changed), refused at split time


class _PeekingModel(LlamaModel):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        position_ids = torch.arange(inputs_embeds.shape[1]).unsqueeze(0)
        gate = inputs_embeds.mean()  # a value of the embeddings, needed by every block
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states * gate, position_embeddings=position_embeddings)
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states)


class _CarryingModel(LlamaModel):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        position_ids = torch.arange(inputs_embeds.shape[1]).unsqueeze(0)
        hidden_states = previous = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers:
            hidden_states, previous = decoder_layer(hidden_states + previous, position_embeddings=position_embeddings), \
                hidden_states
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states)


def _llama_with(base_cls: type) -> LlamaForCausalLM:
    model = make_pp_model("llama", num_hidden_layers=2)
    model.model = base_cls(model.config)
    return model


@pytest.mark.parametrize("make,reason", [
    (lambda: _llama_with(_PeekingModel),
     "_PeekingModel.forward reads the values of the embeddings (TensorBase.mean) to prepare its blocks; a later "
     "stage has only their shape"),
    (lambda: _llama_with(_CarryingModel),
     "_CarryingModel.forward carries ['previous'] from one block to the next; only the hidden states cross "
     "pipeline stages"),
], ids=["embedding-values", "carried-state"])
def test_forward_that_cannot_be_cut_is_refused(make, reason):
    from parallel3d.pipeline.stage import split_model

    with pytest.raises(ConfigError) as info:
        split_model(make(), 2, 0)
    assert str(info.value) == f"pipeline parallelism does not support LlamaForCausalLM (model_type='llama'): {reason}"


def test_parameters_outside_the_plan_are_refused():
    from parallel3d.pipeline.stage import split_model

    model = make_pp_model("llama", num_hidden_layers=2)
    model.model.gate = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        split_model(model, 2, 0)
    assert str(info.value) == (
        "LlamaForCausalLM (model_type='llama'): parameters ['model.gate.weight', 'model.gate.bias'] lie outside its "
        "pipeline plan and head, so no stage would hold them")
