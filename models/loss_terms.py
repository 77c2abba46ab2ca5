"""The terms a Hugging Face causal LM's own ``forward`` adds to its token loss, as a function.

Mixture-of-experts causal LMs add the router's load-balancing loss when ``output_router_logits``
is on (``loss += self.router_aux_loss_coef * aux_loss``, with ``aux_loss`` from the module's own
``load_balancing_loss_func`` over every block's router logits). A forward that replaces the
model's own (tensor parallelism's vocab-parallel head and loss) must add the same terms, or it
trains another model without a word. :class:`ExtraLossTerms` reads the causal LM's ``forward``
(:mod:`models.forward_source`) and keeps, from the statements after its one call of the base
model, those that bind or add to a loss other than the token loss (and the statements they
read); :meth:`ExtraLossTerms.__call__` runs them with the base model's output and a zero in
place of the token loss, so the token loss plus the result equals what ``forward`` returns,
bit for bit (``x + 0.0 == x``). Terms that read the logits, or loss code it cannot separate
from the token loss, raise :class:`~models.forward_source.SourceError`.
"""

from __future__ import annotations

import ast
from typing import Any

import torch
from torch import nn

from models.forward_source import (
    SourceError, assigned_name, calls_of, compile_function, free_names, loads, method_source, parse_statement, stores,
)

__all__ = ["ExtraLossTerms", "adds_to_loss", "extra_loss_terms"]

_TOKEN_LOSS, _AUX = "loss", "aux_loss"


def adds_to_loss(node: ast.AST) -> bool:
    """``loss += t`` or ``loss = loss + t`` with a term ``t`` that does not read the loss
    (``loss = loss + loss`` or ``loss = loss * 2 + 0`` change the token loss itself)."""
    if isinstance(node, ast.AugAssign):
        return (isinstance(node.target, ast.Name) and node.target.id == _TOKEN_LOSS and isinstance(node.op, ast.Add)
                and not _reads_value(node.value, _TOKEN_LOSS))
    return (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [_TOKEN_LOSS]
            and isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Add)
            and isinstance(node.value.left, ast.Name) and node.value.left.id == _TOKEN_LOSS
            and not _reads_value(node.value.right, _TOKEN_LOSS))


def _reads_value(expr: ast.AST, name: str) -> bool:
    """Whether ``expr`` reads ``name`` other than for its ``.device`` or ``.dtype``."""
    parents = {child: node for node in ast.walk(expr) for child in ast.iter_child_nodes(node)}
    return any(isinstance(n, ast.Name) and n.id == name and not (
        isinstance(parents.get(n), ast.Attribute) and parents[n].attr in ("device", "dtype")) for n in ast.walk(expr))


def _sets_loss(node: ast.AST) -> bool:
    """A binding of the loss that is neither an addition to it nor ``loss = None`` (``loss *= ...``
    and the like are ``_scales_loss``)."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or _TOKEN_LOSS not in stores(node) or adds_to_loss(node):
        return False
    return not (isinstance(node.value, ast.Constant) and node.value.value is None)


def _scales_loss(node: ast.AST) -> bool:
    """``loss -= ...``, ``loss *= ...`` and the like: a change of the loss that is no added term."""
    return (isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == _TOKEN_LOSS
            and not isinstance(node.op, ast.Add))


def _rebinds_loss(node: ast.AST) -> bool:
    """``loss = 0.1 * router_z + loss``, ``loss = torch.add(loss, t)``: the loss bound from itself
    in another form than an added term, a change of it rather than its computation."""
    return _sets_loss(node) and node.value is not None and _reads_value(node.value, _TOKEN_LOSS)


def _involved(node: ast.AST) -> bool:
    """Whether ``node`` adds to the loss, changes it otherwise, or reads or binds the auxiliary loss."""
    return (any(adds_to_loss(n) or _scales_loss(n) or _rebinds_loss(n) for n in ast.walk(node))
            or _AUX in loads(node) | stores(node))


def _kind(stmt: ast.stmt) -> str:
    """``"term"`` (adds to the loss or binds the auxiliary loss), ``"token"`` (computes the token
    loss), ``"mixed"`` (both in one statement, or a change of the loss other than an addition,
    which the token loss computed elsewhere would miss) or ``"other"``."""
    nodes = list(ast.walk(stmt))
    term = any(adds_to_loss(n) for n in nodes) or _AUX in loads(stmt) | stores(stmt)
    token = any(_sets_loss(n) for n in nodes)
    if any(_scales_loss(n) or _rebinds_loss(n) for n in nodes) or (term and token):
        return "mixed"
    return "term" if term else "token" if token else "other"


class ExtraLossTerms:
    """The loss terms ``lm_cls.forward`` adds after its call of ``self.<base_attr>`` (module docstring)."""

    def __init__(self, lm_cls: type, base_attr: str) -> None:
        src = method_source(lm_cls)
        self.owner = src.owner
        body = src.body
        kinds = [(stmt, _kind(stmt)) for stmt in body if not isinstance(stmt, ast.Return)]
        terms = [stmt for stmt, kind in kinds if kind == "term"]
        guards = [test for stmt, kind in kinds if kind == "mixed" for test in self._guards(stmt)]
        self.has_terms = bool(terms)
        self.aux_name: str | None = None
        self.guards = [ast.unparse(t) for t in guards]
        self._guard_fn = compile_function(src, "extra_loss_guards", [ast.Return(value=ast.List(elts=guards, ctx=ast.Load()))])
        if not terms:
            return
        calls = calls_of(body, [base_attr])
        if len(calls) != 1:
            raise SourceError(f"{self.owner} adds to its loss, and does not call self.{base_attr} once")
        k = calls[0]
        outputs = assigned_name(body[k])
        after = body[k + 1:]
        if any(stmt not in after for stmt in terms):
            raise SourceError(f"{self.owner} adds to its loss before it calls self.{base_attr}")
        needed = self._inputs(terms, after, outputs, src.params)
        self.aux_name = _AUX if _AUX in stores(terms) else None
        ret = f"return {_TOKEN_LOSS}, {self.aux_name or 'None'}"
        self._fn = compile_function(src, "extra_loss_terms", body[:k] + [parse_statement(f"{outputs} = extra_outputs"),
                                    parse_statement(f"{_TOKEN_LOSS} = extra_zero")] + needed + terms
                                    + [parse_statement(ret)], extra_params=["extra_outputs", "extra_zero"])

    def _guards(self, stmt: ast.stmt) -> list[ast.expr]:
        """The tests of the ``if`` statements that guard the changes of the loss in ``stmt`` other
        than added terms (Bamba's ``if self.z_loss_coefficient > 0:`` inside its token-loss
        statement), which must read only ``self``; SourceError for a change no such test guards."""
        guards: list[ast.expr] = []

        def refuse(node: ast.AST) -> None:
            raise SourceError(f"{self.owner} changes its loss in `{ast.unparse(node).splitlines()[0]}`, beyond adding a "
                              "term to the token loss, which a forward that computes the token loss its own way "
                              "cannot reproduce")

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, ast.stmt) or not _involved(child):
                    continue
                if isinstance(child, ast.If) and loads(child.test) <= {"self"}:
                    guards.append(child.test)
                elif isinstance(child, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                    visit(child)
                else:
                    refuse(child)

        visit(ast.Module(body=[stmt], type_ignores=[]))
        if not guards:
            refuse(stmt)
        return guards

    def check(self, model: nn.Module) -> None:
        """SourceError when ``model``'s config turns on a term added inside the token loss's own
        statement (one this class cannot separate from it)."""
        for text, value in zip(self.guards, self._guard_fn(model)):
            if value:
                raise SourceError(f"{self.owner} adds a term to its token loss when `{text}` (true for this "
                                  "config), which cannot be separated from it")

    def _inputs(self, terms: list[ast.stmt], after: list[ast.stmt], outputs: str, params: list[str]) -> list[ast.stmt]:
        """The statements between the base call and the terms that bind what the terms read."""
        bound = {outputs, _TOKEN_LOSS, "self", *params}
        wanted = set(free_names(terms, bound))
        kept: list[ast.stmt] = []
        for stmt in reversed(after):
            if stmt in terms or not (stores(stmt) & wanted):
                continue
            if "logits" in stores(stmt) or "lm_head" in ast.unparse(stmt):
                raise SourceError(f"{self.owner} adds a loss term that reads the logits "
                                  f"(`{ast.unparse(stmt).splitlines()[0]}`)")
            kept.insert(0, stmt)
            wanted |= set(free_names([stmt], bound))
        return kept

    def __call__(self, model: nn.Module, outputs: Any, zero: torch.Tensor, **forward_kwargs: Any) -> tuple[torch.Tensor, Any]:
        """(the sum of the extra terms, starting from ``zero``; the auxiliary loss or None) for the
        base model's ``outputs`` and the forward's keyword arguments (labels, attention mask, ...)."""
        if not self.has_terms:
            return zero, None  # nothing compiled: the forward adds no term
        return self._fn(model, extra_outputs=outputs, extra_zero=zero, **forward_kwargs)


_CACHE: dict[tuple[type, str], ExtraLossTerms] = {}


def extra_loss_terms(model: nn.Module, base_attr: str) -> ExtraLossTerms:
    """The (cached) :class:`ExtraLossTerms` of ``type(model)``; SourceError when it cannot be read."""
    key = (type(model), base_attr)
    if key not in _CACHE:
        _CACHE[key] = ExtraLossTerms(type(model), base_attr)
    return _CACHE[key]
