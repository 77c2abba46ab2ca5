"""``models.loss_terms``: the loss terms a causal LM's forward adds to its token loss, read from
its source (what tensor parallelism's replacement forward must add too)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from models.forward_source import SourceError
from models.loss_terms import ExtraLossTerms
from parallel3d.errors import ConfigError
from tests.tiny_pp_families import make_family_model, micro_batches


def test_router_loss_is_the_forward_loss_minus_the_token_loss():
    """Mixtral's forward returns token loss + coef x aux loss; the terms give that sum's second part
    bit for bit, and the auxiliary loss itself."""
    model = make_family_model("mixtral_aux")
    batch = micro_batches(2, seed=5)[1]  # right-padded: the router's loss leaves padding out
    whole = model(**batch)
    terms = ExtraLossTerms(type(model), "model")
    assert terms.has_terms and terms.aux_name == "aux_loss"
    base = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    logits = model.lm_head(base.last_hidden_state)
    token = model.loss_function(logits, batch["labels"], vocab_size=model.config.vocab_size)
    extra, aux = terms(model, base, torch.zeros(()), **batch)
    assert torch.equal(aux, whole.aux_loss)
    assert torch.equal(token + extra, whole.loss)
    assert extra.item() == pytest.approx(0.3 * aux.item(), rel=1e-6)


def test_switched_off_terms_add_nothing():
    model = make_family_model("mixtral")  # output_router_logits false
    base = model.model(input_ids=micro_batches(1, seed=5)[0]["input_ids"])
    extra, aux = ExtraLossTerms(type(model), "model")(model, base, torch.zeros(()), labels=None)
    assert aux is None and extra.item() == 0.0


def test_a_dense_model_has_none():
    terms = ExtraLossTerms(transformers.LlamaForCausalLM, "model")
    assert not terms.has_terms and terms.aux_name is None and terms.guards == []


def test_a_term_inside_the_token_loss_is_refused_only_when_on():
    """Bamba adds a z-loss inside its token-loss statement, guarded by its coefficient: the guard
    is read from the source, and only a config that turns it on is refused."""
    terms = ExtraLossTerms(transformers.BambaForCausalLM, "model")
    assert terms.guards == ["self.z_loss_coefficient > 0"]
    terms.check(SimpleNamespace(z_loss_coefficient=0.0))
    with pytest.raises(SourceError, match=r"adds a term to its token loss when `self.z_loss_coefficient > 0`"):
        terms.check(SimpleNamespace(z_loss_coefficient=0.1))


def test_an_unguarded_term_inside_the_token_loss_is_refused():
    with pytest.raises(SourceError) as info:
        ExtraLossTerms(transformers.MusicgenForCausalLM, "model")
    assert str(info.value) == ("MusicgenForCausalLM.forward changes its loss in `loss += loss_fct(codebook_logits, "
                               "codebook_labels)`, beyond adding a term to the token loss, which a forward that "
                               "computes the token loss its own way cannot reproduce")


class _SumsInTheTokenStatement(torch.nn.Module):
    def forward(self, input_ids=None, labels=None):
        outputs = self.model(input_ids)
        aux_loss = outputs.aux
        if labels is not None:
            loss = self.loss_function(outputs.logits, labels) + aux_loss
        return loss


class _ScalesAfterwards(torch.nn.Module):
    def forward(self, input_ids=None, labels=None):
        outputs = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = self.loss_function(outputs.logits, labels)
        if self.halve:
            loss *= 0.5
        return loss


def test_changes_that_are_no_added_term_are_refused():
    """A term summed into the token-loss statement itself, or a scaling of the loss after it, would
    be lost by a forward that computes the token loss its own way: refused (a guarded scaling only
    when its guard is on)."""
    with pytest.raises(SourceError, match=r"changes its loss in `loss = self.loss_function\(outputs.logits, labels\) "
                                          r"\+ aux_loss`, beyond adding a term"):
        ExtraLossTerms(_SumsInTheTokenStatement, "model")
    terms = ExtraLossTerms(_ScalesAfterwards, "model")
    assert terms.guards == ["self.halve"] and not terms.has_terms
    terms.check(SimpleNamespace(halve=False))
    with pytest.raises(SourceError, match=r"when `self.halve`"):
        terms.check(SimpleNamespace(halve=True))


def test_tensor_parallel_refuses_a_term_it_cannot_add():
    from parallel3d.tensor_parallel.forward import check_extra_loss_terms

    config = transformers.AutoConfig.for_model(
        "bamba", hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        vocab_size=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, z_loss_coefficient=0.1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError) as info:
        check_extra_loss_terms(model)
    assert str(info.value) == (
        "BambaForCausalLM.forward adds a term to its token loss when `self.z_loss_coefficient > 0` (true for this "
        "config), which cannot be separated from it; zero3d's tensor-parallel forward computes the token loss on "
        "vocabulary shards and adds only the terms it can read from the model's forward")
