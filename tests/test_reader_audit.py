"""The readers of model code fail closed (issue 28, item 6).

For each reader, forwards a user could plausibly write: each is either run as eager runs it
(equal results) or refused before training with the model class, the statement and what is
allowed. The pipeline's stage programs are compared in one process: stage 0 and stage 1 of a
two-stage split run one after the other (no collective is needed to run a stage's forward).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from models.forward_source import SourceError
from models.loss_terms import ExtraLossTerms
from parallel3d.errors import ConfigError
from parallel3d.pipeline.stage import split_model
from tests.head_variants import variant
from tests.stage_variants import base_variant, scaled
from tests.tiny_pp import make_pp_model, micro_batches

HEAD = "logits = self.lm_head(hidden_states)"


def _llama(base_cls: type | None = None, lm_cls: type | None = None) -> torch.nn.Module:
    model = make_pp_model("llama", attn="eager").double()
    if base_cls is not None:
        model.model.__class__ = base_cls
    if lm_cls is not None:
        model.__class__ = lm_cls
    return model


def _two_stages(model: torch.nn.Module, batch: dict, grads: dict | None = None) -> torch.Tensor:
    """The loss of ``batch`` through stage 0, then stage 1, of a two-stage split; with ``grads``,
    its backward too, each parameter's gradient put there under its HF name."""
    first = split_model(copy.deepcopy(model), 2, 0)
    last = split_model(copy.deepcopy(model), 2, 1)
    mask = batch.get("attention_mask")
    hidden = first.chunks[0](batch["input_ids"], mask)
    received = hidden.detach().requires_grad_()
    loss = last.chunks[0](received, mask, labels=batch["labels"])
    if grads is not None:
        loss.backward()
        hidden.backward(received.grad)
        for pipe in (first, last):
            grads.update({n: p.grad for n, p in pipe.hf_named_parameters()})
    return loss


def _pipeline_equals_eager(model: torch.nn.Module) -> None:
    """Loss and every parameter's gradient of two micro-batches, stage by stage against eager."""
    for batch in micro_batches(2):
        model.zero_grad(set_to_none=True)
        want = model(**batch).loss
        want.backward()
        grads: dict = {}
        assert _two_stages(model, batch, grads).item() == pytest.approx(want.item(), rel=1e-12)
        for name, p in model.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-10, atol=1e-14), name


# --------------------------------------------------------------------------- the base model's forward

BASE_REFUSED = {
    # the loop skips, repeats or reorders blocks: a stage would run its share of all of them, in order
    "every_second_block": (dict(blocks="self.layers[::2]"), "does not visit each of its 8 blocks once"),
    "first_block_skipped": (dict(blocks="self.layers[1:]"), "does not visit each of its 8 blocks once"),
    "shifted_index": (dict(target="i, decoder_layer", blocks="enumerate(self.layers[1:])"),
                      "once, in order, with its index"),
    # what follows the loop gives no (batch, sequence, width) tensor
    "last_hidden_state_cut": (dict(post="hidden_states = self.norm(hidden_states)[0]"),
                              "needs a tensor of shape (batch, sequence, width)"),
    # an in-place change of the embeddings before the loop: a later stage would apply it to what it received
    "in_place_before_loop": (dict(pre="hidden_states.mul_(2.0)"), "reads the values of the embeddings"),
    # decorators whose effect reading the statements would drop
    "no_grad_decorator": (dict(decorator="@torch.no_grad()"), "is decorated with `@torch.no_grad()`"),
    "users_decorator": (dict(decorator="@scaled(0.5)"), "is decorated with `@scaled(0.5)`"),
}


@pytest.mark.parametrize("case", sorted(BASE_REFUSED))
def test_base_forward_variants_are_refused_by_name(case):
    kwargs, said = BASE_REFUSED[case]
    with pytest.raises(ConfigError, match="pipeline parallelism does not support") as caught:
        split_model(_llama(base_variant(f"Base_{case}", **kwargs)), 2, 0)
    assert said in str(caught.value) and f"Base_{case}.forward" in str(caught.value)


def test_a_wrapper_applied_after_the_class_is_refused():
    """``Model.forward = wrap(Model.forward)``: no decorator in the source, a wrapper around it."""
    cls = type("WrappedAfter", (base_variant("WrappedPlain"),), {})
    cls.forward = scaled(0.5)(base_variant("WrappedPlain").forward)
    with pytest.raises(ConfigError, match=r"is wrapped by scaled.<locals>.wrap.<locals>.run "
                                          r"\(.*stage_variants.py:\d+\)"):
        split_model(_llama(cls), 2, 0)


def test_a_block_step_that_returns_something_else_is_refused_when_run():
    """A block returns a tensor; ``hidden_states = decoder_layer(...)[0]`` cuts off the batch
    dimension. The split-time probe cannot know what a block returns, so the first block step
    refuses (on stage 0, before anything is sent)."""
    model = _llama(base_variant("Base_indexed_output", body="hidden_states = hidden_states[0]"))
    batch = micro_batches(1)[0]
    with pytest.raises(SourceError, match=r"Base_indexed_output.forward: the block loop's body gives block 0's next "
                                          r"hidden states as a tensor of shape \(8, 32\)"):
        _two_stages(model, batch)


BASE_ACCEPTED = {
    "scaled_between_blocks": dict(body="hidden_states = hidden_states * 0.5"),
    "per_index": dict(target="i, decoder_layer", blocks="enumerate(self.layers[: self.config.num_hidden_layers])",
                      body="if i % 2 == 1:\n    hidden_states = hidden_states * 0.5"),
    "scaled_embeddings": dict(pre="hidden_states = hidden_states * 2.0"),
    "all_blocks_unsliced": dict(blocks="self.layers"),
    "in_place_between_blocks": dict(body="hidden_states.mul_(0.5)"),
}


@pytest.mark.parametrize("case", sorted(BASE_ACCEPTED))
def test_base_forward_variants_run_as_eager(case):
    _pipeline_equals_eager(_llama(base_variant(f"BaseOk_{case}", **BASE_ACCEPTED[case])))


# --------------------------------------------------------------------------- the model instance


def test_a_forward_set_on_the_instance_is_refused():
    model = _llama()
    model.model.forward = functools.partial(type(model.model).forward, model.model)
    with pytest.raises(ConfigError, match=r"model \(LlamaModel\) has a forward of its own set on the instance"):
        split_model(model, 2, 0)


@pytest.mark.parametrize("where", ["model", "model.model"])
def test_hooks_on_modules_whose_forward_is_read_are_refused(where):
    model = _llama()
    model.get_submodule(where.partition(".")[2]).register_forward_hook(lambda m, a, out: out)
    with pytest.raises(ConfigError, match="_forward_hooks registered"):
        split_model(model, 2, 0)


def test_a_global_forward_hook_is_refused():
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    try:
        with pytest.raises(ConfigError, match="global _forward_pre_hooks registered"):
            split_model(_llama(), 2, 0)
    finally:
        handle.remove()


def test_a_hook_on_a_block_runs_as_eager():
    """Blocks are called as modules by the stage too: their hooks run in both."""
    model = _llama()
    model.model.layers[5].register_forward_hook(lambda m, a, out: out * 0.5)
    _pipeline_equals_eager(model)


# --------------------------------------------------------------------------- the causal LM's forward

HEAD_REFUSED = {
    "reads_attention_mask": (dict(head=HEAD + "\nif attention_mask is not None:\n    logits = logits * "
                                  "attention_mask[..., None]"), "from its argument(s) ['attention_mask']"),
    "reads_input_ids_through_a_local": (dict(head="n = input_ids.shape[1]\n" + HEAD + "\nlogits = logits[:, -n:]"),
                                        "from its argument(s) ['input_ids']"),
    "changed_input": (dict(head=HEAD, input_ids="input_ids % 7"), "passes its base model `input_ids=input_ids % 7`"),
    "transposed_logits": (dict(head=HEAD + "\nlogits = logits.transpose(1, 2)"),
                          "gives its logits as a tensor of shape (1, 96, 2)"),
}


@pytest.mark.parametrize("case", sorted(HEAD_REFUSED))
def test_causal_lm_forward_variants_are_refused_by_name(case):
    kwargs, said = HEAD_REFUSED[case]
    with pytest.raises(ConfigError, match="pipeline parallelism does not support") as caught:
        split_model(_llama(lm_cls=variant(f"Head_{case}", **kwargs)), 2, 0)
    assert said in str(caught.value) and f"Head_{case}.forward" in str(caught.value)


def test_soft_capped_logits_run_as_eager():
    _pipeline_equals_eager(_llama(lm_cls=variant("HeadOk_tanh", HEAD + "\nlogits = torch.tanh(logits / 3.0) * 3.0")))


# --------------------------------------------------------------------------- the loss terms


def test_a_term_added_in_front_of_the_loss_is_refused():
    """``loss = t + loss`` was read as computing the token loss and the term was dropped: tensor
    parallelism's forward would have trained without it."""
    loss = ("loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)\n"
            "loss = 0.01 * hidden_states.pow(2).mean() + loss")
    with pytest.raises(SourceError, match=r"Loss_term_in_front.forward changes its loss in `loss = 0.01 \* "
                                          r"hidden_states.pow\(2\).mean\(\) \+ loss`"):
        ExtraLossTerms(variant("Loss_term_in_front", HEAD, loss), "model")


def test_a_term_added_through_torch_add_is_refused():
    loss = ("loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)\n"
            "loss = torch.add(loss, hidden_states.mean())")
    with pytest.raises(SourceError, match="changes its loss in `loss = torch.add"):
        ExtraLossTerms(variant("Loss_torch_add", HEAD, loss), "model")
