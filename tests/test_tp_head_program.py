"""The tensor-parallel forward fails closed on what a forward does between base model and loss.

Every form a user writes that the replacement forward would not reproduce is refused with the
statement named, before any collective (``prepare_tensor_parallel`` is a check without a group);
elementwise maps with scalar operands are run on the vocabulary slice and match one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.apply import prepare_tensor_parallel
from tests.head_variants import variant
from tests.tiny_tp import make_tp_model, tp_batch, tp_group

HEAD = "logits = self.lm_head(hidden_states)"

REFUSED = {
    "call_on_logits": (HEAD + "\nlogits = self.logit_norm(logits)", "self.logit_norm(logits)"),
    "method_of_logits": (HEAD + "\nlogits = logits.softmax(-1)", "logits.softmax(-1)"),
    "in_place_op": (HEAD + "\nlogits.div_(2.0)", "changes a tensor in place"),
    "in_place_slice": (HEAD + "\nlogits[..., 0] = 0.0", "changes a tensor in place"),
    "hidden_norm": ("hidden_states = self.logit_norm(hidden_states)\n" + HEAD, "self.logit_norm(hidden_states)"),
    "head_input": ("logits = self.lm_head(self.logit_norm(hidden_states))", "feeds the head"),
    "vector_operand": (HEAD + "\nlogits = logits * self.vocab_scale", "a tensor of shape (127,)"),
    "data_dependent_guard": (HEAD + "\nif labels is None:\n    logits = logits * 2.0", "cannot evaluate"),
    "derived_logits": (HEAD + "\nclipped = logits.clamp(-5.0, 5.0)", "clipped = logits.clamp"),
    "hidden_in_place": ("hidden_states.mul_(2.0)\n" + HEAD, "changes a tensor in place"),
    "output_in_place": ("outputs.last_hidden_state.mul_(2.0)\n" + HEAD, "changes a tensor in place"),
    "changed_labels": (HEAD + "\nlabels = labels.masked_fill(labels == 3, -100)", "rebinds labels"),
    "renamed_logits": ("lm_logits = self.lm_head(hidden_states)\nlm_logits = self.logit_norm(lm_logits)\n"
                       "logits = lm_logits", "self.logit_norm(lm_logits)"),  # Falcon's name for them
    "aliased_in_place": ("h = outputs.last_hidden_state\nh.mul_(2.0)\n" + HEAD, "changes a tensor in place"),
    "rebound_input": ("input_ids = input_ids % 7\n" + HEAD, "rebinds input_ids"),
    "changed_kwargs": (HEAD + "\nkwargs = dict(kwargs, ignore_index=0)", "rebinds kwargs"),
    "trainable_operand": (HEAD + "\nlogits = logits * self.logit_gain", "a trainable tensor"),
    "config_local_rebound": ("cap = self.config.logits_scaling\nif labels is not None:\n    cap = None\n"
                             + HEAD + "\nif cap is not None:\n    logits = logits / cap", "`cap`"),
    "logits_after_loss": ("logits = self.lm_head(hidden_states)\nloss = self.loss_function(logits, labels, "
                          "self.config.vocab_size)\nlogits = logits * 2.0", "after the loss"),
    "cast_to_a_local": (HEAD + "\nlogits = logits.to(hidden_states.dtype)", "converts to a value"),
}
REFUSED_LOSS = {
    "transform_in_loss": "loss = self.loss_function(torch.tanh(logits), labels, self.config.vocab_size, **kwargs)",
    "scaled_loss": "loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs) * 2.0",
    "own_loss": "loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())",
    "rescaled_after": "loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)\n"
                      "loss = loss * 2.0",
    "loss_added_to_itself": "loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)\n"
                            "loss = loss + loss",
    "splatted_options": "loss = self.loss_function(logits, labels, self.config.vocab_size, **dict(ignore_index=0))",
    "other_labels": "loss = self.loss_function(logits, labels + 1, self.config.vocab_size, **kwargs)",
}


def _model(cls: type, **config) -> nn.Module:
    model = make_tp_model("llama", **config)
    model.__class__ = cls
    model.logit_norm = nn.LayerNorm(model.config.vocab_size)
    model.register_buffer("vocab_scale", torch.ones(model.config.vocab_size))
    model.logit_gain = nn.Parameter(torch.tensor(2.0))
    return model


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_forward_does_with_the_logits_is_refused_by_name(case):
    head, said = REFUSED[case]
    with pytest.raises(ConfigError, match="tensor") as caught:
        prepare_tensor_parallel(_model(variant(f"Refused_{case}", head)), 2)
    assert said in str(caught.value) and f"Refused_{case}.forward" in str(caught.value)


@pytest.mark.parametrize("case", sorted(REFUSED_LOSS))
def test_a_loss_other_than_the_causal_lm_loss_is_refused(case):
    with pytest.raises(ConfigError, match="loss") as caught:
        prepare_tensor_parallel(_model(variant(f"Loss_{case}", HEAD, REFUSED_LOSS[case])), 2)
    assert REFUSED_LOSS[case].splitlines()[-1].split(" = ")[1][:30] in str(caught.value)


def test_other_inputs_of_the_base_model_are_refused():
    with pytest.raises(ConfigError, match="passes its base model `input_ids=input_ids % 7`"):
        prepare_tensor_parallel(_model(variant("OtherInputs", HEAD, input_ids="input_ids % 7")), 2)


@pytest.mark.parametrize("returned", ["loss * 2.0", "torch.tanh(logits)"])
def test_outputs_computed_from_the_loss_or_logits_are_refused(returned):
    ret = f"CausalLMOutputWithPast(loss={returned if 'loss' in returned else 'loss'}, logits={returned if 'logits' in returned else 'logits'})"
    with pytest.raises(ConfigError, match="returns"):
        prepare_tensor_parallel(_model(variant(f"Returns_{returned[:4]}", HEAD, ret=ret)), 2)


def test_a_loss_function_of_the_users_is_refused():
    model = _model(variant("Plain", HEAD))
    model._loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(ConfigError, match="not transformers' causal LM loss"):
        prepare_tensor_parallel(model, 2)


def test_a_statement_under_a_false_config_test_never_runs():
    cls = variant("Guarded", HEAD + "\nif self.config.logit_clip:\n    logits = self.logit_norm(logits)")
    prepare_tensor_parallel(_model(cls, logit_clip=False), 2)
    with pytest.raises(ConfigError, match="self.logit_norm"):
        prepare_tensor_parallel(_model(cls, logit_clip=True), 2)


# accepted: run on this rank's vocabulary slice, so the result matches one process
ACCEPTED = {
    "tanh_scaled": HEAD + "\nlogits = torch.tanh(logits) * 3.0",  # the fault probe's case
    "multiplied_in_head_statement": "logits = self.lm_head(hidden_states) * self.config.logits_scaling",
    "scaled_hidden": "hidden_states = hidden_states / self.config.logits_scaling\n" + HEAD,
    "augmented": HEAD + "\nlogits /= self.config.logits_scaling\nlogits = logits.to(torch.float64)",
}


def _tp_against_one_process(case: str) -> dict:
    from parallel3d.tensor_parallel import apply_tensor_parallel

    ref = _model(variant(f"Accepted_{case}", ACCEPTED[case]), logits_scaling=0.25).double()
    model = copy.deepcopy(ref)
    batch = tp_batch(ref.config.vocab_size)
    want = ref(**batch)
    want.loss.backward()
    apply_tensor_parallel(model, tp_group(2))
    got = model(**batch, gather_logits=True)
    got.loss.backward()
    full = dict(ref.named_parameters())
    return {"loss": (got.loss.item(), want.loss.item()),
            "logits": ((got.logits - want.logits).abs().max() / want.logits.abs().max()).item(),
            "head_grad_norm": (model.lm_head.weight.grad.norm().item(), full["lm_head.weight"].grad.norm().item())}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_elementwise_maps_run_on_the_slice_and_match_one_process(dist, case):
    for r in dist.run(2, _tp_against_one_process, case):
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-9)
        assert r["logits"] < 1e-12
        assert r["head_grad_norm"][0] < r["head_grad_norm"][1]  # a slice of the full gradient, not all of it
