"""What a causal LM's ``forward`` does between its base model and its loss, read from its source.

Tensor parallelism replaces the model's ``forward`` (``forward.causal_lm_forward``): base model
-> this rank's vocabulary slice of the logits -> the vocabulary-parallel loss. Everything the
model's own forward does on that path must be done again there, or the model trains another loss
without a word. This module reads the forward's syntax tree (:mod:`models.forward_source`) and
fails closed: every statement after the base-model call that binds, changes or reads the hidden
states fed to the head, the logits or the token loss must be one of the forms below, or
:meth:`HeadProgram.check` raises ``ConfigError`` naming it.

Reproduced:
- taking the hidden states from the base model's output and slicing them to ``logits_to_keep``
  (the replacement does both itself);
- elementwise changes of the hidden states before the head and of the logits after it, with
  scalar operands (Cohere's ``logits * self.logit_scale``, Granite's ``/ logits_scaling``, Gemma's
  soft-capping ``tanh``, MiniCPM3's scaled hidden states, Falcon-H1's ``lm_head_multiplier``):
  these statements, under their config-only ``if`` tests, are compiled into :attr:`pre` and
  :attr:`post` and run on the rank's slice, which an elementwise map leaves exact;
- the token loss as ``loss = self.loss_function(logits, labels, ...)`` with transformers'
  causal LM loss.

Statements under an ``if`` whose test reads only the config (``self.config....``) and is false
for the model at hand never run, so they are not refused (Bamba's z-loss when its coefficient is
0). Extra loss terms (the router's loss) are :mod:`models.loss_terms`' part.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from models.forward_source import (
    SourceError, compile_function, loads, method_source, parse_statement, stores,
)
from models.loss_terms import adds_to_loss
from parallel3d.errors import ConfigError

__all__ = ["HeadProgram", "head_program"]

_LOSS, _LABELS = "loss", "labels"
# arguments the replacement passes on as the caller gave them: a forward may not rebind them
_PASSED_AS_GIVEN = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "logits_to_keep", "num_items_in_batch", "shift_labels", "kwargs")
_TO_BASE = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds")
_FLAGS = {"return_dict", "output_attentions", "output_hidden_states", "use_cache"}
_ELEMENTWISE_FUNCS = {"torch.tanh", "nn.functional.tanh", "torch.nn.functional.tanh", "F.tanh", "torch.sigmoid"}
_ELEMENTWISE_METHODS = {"float", "double", "to", "contiguous", "tanh", "sigmoid"}
_METADATA = {"device", "dtype", "shape", "size", "ndim", "dim"}
_SLICE_FUNCS = {"slice_logits_to_keep"}
_LOSS_KEYWORDS = {"logits", "labels", "vocab_size", "pad_token_id"}
_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)


@dataclass
class _Found:
    """A statement the replacement forward cannot reproduce, and the config-only tests it runs under."""

    text: str
    guards: list[tuple[ast.expr, bool]]


@dataclass
class _Walk:
    head_attr: str
    hidden: str
    head_seen: bool = False
    post: list[ast.stmt] = field(default_factory=list)
    pre: list[ast.stmt] = field(default_factory=list)
    refused: list[_Found] = field(default_factory=list)
    operands: list[tuple[ast.expr, list[tuple[ast.expr, bool]], str]] = field(default_factory=list)
    calls_loss_function: bool = False
    loss_seen: bool = False


def _text(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0]


def _is_self_chain(node: ast.expr) -> bool:
    """``self.a.b``, optionally through ``.get_text_config()`` (a config value)."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get_text_config":
            node = node.func.value
        else:
            return isinstance(node, ast.Name) and node.id == "self"


def _reads_training(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "training" for n in ast.walk(node))


class HeadProgram:
    """The head path of ``type(model).forward`` (module docstring), for the head at ``self.<head_attr>``."""

    def __init__(self, cls: type, base_attr: str, head_attr: str) -> None:
        self.owner = f"{cls.__name__}.forward"
        src = method_source(cls)
        self._src = src
        body = src.body
        calls = [i for i, stmt in enumerate(body) if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                 and isinstance(stmt.value, ast.Call) and _text(stmt.value.func).split(".")[:2] == ["self", base_attr]]
        if len(calls) != 1:  # self.model(...), or OPT's self.model.decoder(...)
            raise SourceError(f"{self.owner} does not call self.{base_attr} once")
        k = calls[0]
        self._outputs = stores(body[k])
        self._check_base_call(body[k].value)
        self._config_locals: set[str] = set()
        self._bindings = []  # top-level `name = <config value>` (Gemma 3n's soft-cap, RecurrentGemma's cap)
        for stmt in body:
            if self._is_config_binding(stmt, set()):
                self._bindings.append(stmt)
                self._config_locals |= stores(stmt)
        for node in ast.walk(src.node):  # `if (cap := self.config.cap) is not None:` (Gemma 4's)
            if isinstance(node, ast.NamedExpr) and self._config_only(node.value):
                self._config_locals.add(node.target.id)
        # a name is the config's only if nothing else ever binds it (`cap = None` under a runtime test)
        config_bindings = {id(b) for b in self._bindings} | {id(n) for n in ast.walk(src.node)
                                                              if isinstance(n, ast.NamedExpr)}
        for node in ast.walk(src.node):
            if isinstance(node, (ast.stmt, ast.NamedExpr)) and id(node) not in config_bindings \
                    and not isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef)):
                targets = stores(node) if not isinstance(node, ast.NamedExpr) else {node.target.id}
                self._config_locals -= targets
        self._bindings = [b for b in self._bindings if stores(b) <= self._config_locals]
        heads = [n for s in body[k + 1:] for n in ast.walk(s) if isinstance(n, ast.Call)
                 and _text(n.func) == f"self.{head_attr}"]
        if not heads:
            raise SourceError(f"{self.owner} does not call its output embeddings self.{head_attr} after the base model")
        head_statement = next(stmt for stmt, _, _ in self._statements(body[k + 1:], [], False)
                              if any(n is heads[0] for n in ast.walk(stmt)))
        if not (isinstance(head_statement, ast.Assign) and len(head_statement.targets) == 1
                and isinstance(head_statement.targets[0], ast.Name)):
            raise SourceError(f"{self.owner} does not bind the head's output to a name (`{_text(head_statement)}`)")
        self._logits = head_statement.targets[0].id  # "logits"; Falcon's "lm_logits"
        walk = _Walk(head_attr, hidden="")
        reason = self._head_call(heads[0], walk)
        if reason:
            raise SourceError(f"{self.owner} {reason}")
        for stmt, guards, opaque in self._statements(body, [], False):
            reason = self._whole_forward_reason(stmt)
            if reason is not None:
                walk.refused.append(_Found(f"`{_text(stmt)}` ({reason})", guards))
        for stmt, guards, opaque in self._statements(body[k + 1:], [], False):
            self._classify(stmt, guards, opaque, walk)
        self._walk = walk
        self.pre = self._compile("head_program_pre", body[k + 1:], walk.pre, walk.hidden)
        self.post = self._compile("head_program_post", body[k + 1:], walk.post, self._logits)

    # -- reading ---------------------------------------------------------------------------------
    def _check_base_call(self, call: ast.Call) -> None:
        """The replacement calls the base model with the forward's own arguments: refuse a call
        that passes it anything else (``input_ids=input_ids * 0``), flags aside."""
        params = set(self._src.params)
        passed = {_text(a) for a in call.args} | {k.arg for k in call.keywords if k.arg is not None}
        left_out = [name for name in _TO_BASE if name in params and name not in passed]
        if left_out:
            raise SourceError(f"{self.owner} does not pass its base model {', '.join(left_out)}, which the replacement "
                              "forward passes on")
        for value, key in [(a, None) for a in call.args] + [(k.value, k.arg) for k in call.keywords]:
            if key is None and isinstance(value, ast.Starred):
                value = value.value
            if isinstance(value, ast.Name) and value.id in params and key in (None, value.id):
                continue
            if key is None and isinstance(value, ast.Name) and value.id in params:
                continue
            if key in _FLAGS and (isinstance(value, ast.Constant) or (isinstance(value, ast.Name) and value.id in params)):
                continue
            raise SourceError(f"{self.owner} passes its base model `{key + '=' if key else ''}{_text(value)}`, which "
                              "the replacement forward, calling it with the forward's own arguments, would not")

    def _whole_forward_reason(self, stmt: ast.stmt) -> str | None:
        """Why ``stmt``, anywhere in the forward, changes what the replacement takes as given: a
        change in place, or a rebinding of an argument it passes on (labels moved to a device aside)."""
        if _in_place(stmt):
            return "changes a tensor in place, which the replacement forward would not"
        rebound = stores(stmt) & set(_PASSED_AS_GIVEN) & set(self._src.params)
        if rebound and not (rebound == {_LABELS} and self._moves_labels(stmt)):
            what = ", ".join(sorted(rebound))
            return f"rebinds {what}, which the replacement forward passes on as the caller gave it"
        return None

    @staticmethod
    def _moves_labels(stmt: ast.stmt) -> bool:
        """``labels = labels.to(...)``: the same labels on another device."""
        value = _bound_value(stmt, _LABELS)
        return (isinstance(stmt, ast.Assign) and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and value.func.attr == "to" and _text(value.func.value) == _LABELS)

    def _is_config_binding(self, stmt: ast.stmt, extra: set[str]) -> bool:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return False
        return self._config_only(stmt.value, extra)

    def _config_only(self, expr: ast.expr, extra: set[str] = frozenset()) -> bool:
        names = loads(expr)
        local = self._config_locals | set(extra)
        return (not _reads_training(expr) and bool(names & (local | {"self"}))
                and all(n == "self" or n in local or self._src.is_global(n) for n in names))

    def _statements(self, stmts: list[ast.stmt], guards: list[tuple[ast.expr, bool]],
                    opaque: bool) -> Iterator[tuple[ast.stmt, list[tuple[ast.expr, bool]], bool]]:
        """Every simple statement, with the config-only tests above it (and their branch) and
        whether another condition or a loop stands above it too."""
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                config = self._config_only(stmt.test)
                yield from self._statements(stmt.body, guards + [(stmt.test, True)] if config else guards,
                                            opaque or not config)
                yield from self._statements(stmt.orelse, guards + [(stmt.test, False)] if config else guards,
                                            opaque or not config)
            elif isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(stmt, block, None) or []
                    inner = [s for h in inner for s in h.body] if block == "handlers" else inner
                    yield from self._statements(inner, guards, True)
            else:
                yield stmt, guards, opaque

    def _classify(self, stmt: ast.stmt, guards: list[tuple[ast.expr, bool]], opaque: bool, walk: _Walk) -> None:
        bound, read = stores(stmt), loads(stmt)
        refuse = walk.refused.append
        if self._logits in bound or self._mutates(stmt, self._logits):
            reason = ("changes the logits after the loss was computed from them" if walk.loss_seen
                      else self._logit_statement(stmt, walk, guards))
            if reason is None and opaque:
                reason = "runs under a condition the replacement forward cannot evaluate"
            if reason is not None:
                refuse(_Found(f"`{_text(stmt)}` ({reason})", guards))
            elif not self._is_identity(stmt):
                walk.post.append(stmt)
            return
        hidden = walk.hidden
        if any(self._mutates(stmt, name) for name in (hidden, *self._outputs)):
            refuse(_Found(f"`{_text(stmt)}` (changes the base model's output in place)", guards))
            return
        if hidden in bound and not walk.head_seen and self._logits not in read and _LOSS not in bound:
            reason = self._hidden_statement(stmt, hidden, walk, guards)
            if reason is None and opaque and not self._is_slice_or_extraction(stmt, hidden):
                reason = "runs under a condition the replacement forward cannot evaluate"
            if reason is not None:
                refuse(_Found(f"`{_text(stmt)}` ({reason})", guards))
            elif not self._is_slice_or_extraction(stmt, hidden):
                walk.pre.append(stmt)
            return
        if _LOSS in bound and self._logits not in read and not self._known_loss_binding(stmt):
            refuse(_Found(f"`{_text(stmt)}` (changes the loss in a form the replacement forward does not reproduce; "
                          "it adds terms to the token loss, nothing else)", guards))
            return
        if isinstance(stmt, ast.Return):
            reason = self._return_reason(stmt)
            if reason is not None:
                refuse(_Found(f"`{_text(stmt)}` ({reason})", guards))
            return
        if self._logits in read:
            reason = self._reader(stmt, walk)
            if reason is not None:
                refuse(_Found(f"`{_text(stmt)}` ({reason})", guards))

    @staticmethod
    def _mutates(stmt: ast.stmt, name: str) -> bool:
        """``name[...] = ...`` or ``name.op_(...)``: a change in place."""
        for node in ast.walk(stmt):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, (ast.Subscript, ast.Attribute)) and _root(t) == name for t in targets):
                    return True
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_") \
                    and not node.func.attr.startswith("_") and _root(node.func.value) == name:
                return True
        return False

    def _is_slice_or_extraction(self, stmt: ast.stmt, hidden: str) -> bool:
        """``h = outputs.last_hidden_state`` / ``outputs[0]`` (either under ``if return_dict``), or
        ``h = slice_logits_to_keep(h or those, logits_to_keep)``: what the replacement does itself."""
        if not (isinstance(stmt, ast.Assign) and [_text(t) for t in stmt.targets] == [hidden]):
            return False
        value = stmt.value
        if isinstance(value, ast.Call) and _text(value.func) in _SLICE_FUNCS:
            value = value.args[0] if value.args else value
            if isinstance(value, ast.Name) and value.id == hidden:
                return True
        return self._extraction(value)

    def _extraction(self, value: ast.expr) -> bool:
        if isinstance(value, ast.IfExp):
            return self._extraction(value.body) and self._extraction(value.orelse)
        if isinstance(value, ast.Attribute) and value.attr == "last_hidden_state":
            return isinstance(value.value, ast.Name) and value.value.id in self._outputs
        if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == 0:
            return isinstance(value.value, ast.Name) and value.value.id in self._outputs
        return False

    def _logit_statement(self, stmt: ast.stmt, walk: _Walk, guards: list[tuple[ast.expr, bool]]) -> str | None:
        """None when ``stmt`` (which binds or changes the logits) is the head or an elementwise map."""
        if self._mutates(stmt, self._logits):
            return "changes the logits in place"
        value = _bound_value(stmt, self._logits)
        if value is None:
            return "binds the logits in a form the replacement forward does not know"
        heads = [n for n in ast.walk(value) if isinstance(n, ast.Call) and _text(n.func) == f"self.{walk.head_attr}"]
        if heads:
            if walk.head_seen or len(heads) != 1:
                return "calls the head again"
            walk.head_seen = True
            value = _Replace(heads[0], self._logits).visit(_copy(value))
            if not isinstance(stmt, ast.Assign):
                return "binds the logits in a form the replacement forward does not know"
            stmt.value = value  # the compiled copy starts from the head's output
        elif not walk.head_seen:
            return "computes the logits other than with the output embeddings"
        return self._elementwise(value, self._logits, walk, guards)

    def _head_call(self, call: ast.Call, walk: _Walk) -> str | None:
        if len(call.args) != 1 or call.keywords:
            return "calls the head with other arguments than the hidden states"
        arg = call.args[0]
        while isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "to":
            arg = arg.func.value
        if isinstance(arg, ast.Subscript):
            if not loads(arg.slice) <= {"slice_indices", "logits_to_keep"}:
                return f"feeds the head `{_text(arg)}`, not the hidden states sliced to logits_to_keep"
            arg = arg.value
        if not isinstance(arg, ast.Name):
            return f"feeds the head `{_text(arg)}`, not the base model's hidden states"
        walk.hidden = arg.id
        return None

    def _hidden_statement(self, stmt: ast.stmt, hidden: str, walk: _Walk,
                          guards: list[tuple[ast.expr, bool]]) -> str | None:
        if self._is_slice_or_extraction(stmt, hidden):
            return None
        value = _bound_value(stmt, hidden)
        if value is None:
            return "changes the hidden states the head reads in a form the replacement forward does not know"
        for node in ast.walk(value):  # the base model's output read again: the extraction, transformed
            if isinstance(node, ast.Attribute) and node.attr == "last_hidden_state" and _text(node.value) in self._outputs:
                return "changes the hidden states the head reads in a form the replacement forward does not know"
        return self._elementwise(value, hidden, walk, guards)

    def _elementwise(self, expr: ast.expr, var: str, walk: _Walk, guards: list[tuple[ast.expr, bool]]) -> str | None:
        """None when ``expr`` is an elementwise map of ``var`` with scalar operands (whose values
        :meth:`check` reads); else why not."""
        if isinstance(expr, ast.Name) and expr.id == var:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, (int, float)):
            return None
        if var not in loads(expr) and (_is_self_chain(expr) or (isinstance(expr, ast.Name)
                                                                and expr.id in self._config_locals)):
            walk.operands.append((expr, guards, var))
            return None
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, _OPS):
            return self._elementwise(expr.left, var, walk, guards) or self._elementwise(expr.right, var, walk, guards)
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, (ast.USub, ast.UAdd)):
            return self._elementwise(expr.operand, var, walk, guards)
        if isinstance(expr, ast.Call) and not expr.keywords and _text(expr.func) in _ELEMENTWISE_FUNCS \
                and len(expr.args) == 1:
            return self._elementwise(expr.args[0], var, walk, guards)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in _ELEMENTWISE_METHODS:
            if expr.func.attr == "to" and not all(self._is_constant(a) for a in (*expr.args, *[k.value for k in expr.keywords])):
                return f"`{_text(expr)}` converts to a value the replacement forward does not have"
            if expr.func.attr != "to" and (expr.args or expr.keywords):
                return f"`{_text(expr)}` is not an elementwise map the replacement forward can run on a shard"
            return self._elementwise(expr.func.value, var, walk, guards)
        return f"`{_text(expr)}` is not an elementwise map the replacement forward can run on a shard"

    def _is_constant(self, expr: ast.expr) -> bool:
        """A value of the config or module (``self.lm_head.weight.dtype``) or a global (``torch.float32``)."""
        names = loads(expr)
        return not _reads_training(expr) and all(n == "self" or n in self._config_locals or self._src.is_global(n)
                                                 for n in names) and not any(isinstance(n, ast.Call) for n in ast.walk(expr))

    @staticmethod
    def _is_identity(stmt: ast.stmt) -> bool:
        return isinstance(stmt, ast.Assign) and _text(stmt.value) == _text(stmt.targets[0])

    def _reader(self, stmt: ast.stmt, walk: _Walk) -> str | None:
        """None when every read of the logits in ``stmt`` is one the replacement forward gives the
        same value: metadata, an element of the returned outputs, the causal LM loss's argument."""
        parents = {child: node for node in ast.walk(stmt) for child in ast.iter_child_nodes(node)}
        loss_call = self._loss_call(stmt)
        if loss_call is not None:
            walk.calls_loss_function = walk.loss_seen = True
        for node in ast.walk(stmt):
            if not (isinstance(node, ast.Name) and node.id == self._logits):
                continue
            parent = parents.get(node)
            if isinstance(parent, ast.Attribute) and parent.attr in _METADATA:
                continue
            if isinstance(parent, ast.keyword):
                parent = parents.get(parent)
            if loss_call is not None and parent is loss_call:
                continue
            if _LOSS in stores(stmt):
                return ("computes the loss in a form the replacement forward does not know; it computes "
                        "`loss = self.loss_function(logits, labels, vocab_size, **kwargs)` on vocabulary shards")
            if isinstance(parent, (ast.Tuple, ast.List)):
                continue
            return "reads the logits in a form the replacement forward does not reproduce"
        return None

    def _return_reason(self, stmt: ast.Return) -> str | None:
        """The outputs may carry the loss and the logits as they are (a keyword or a tuple element;
        the loss also compared with None), nothing computed from them."""
        parents = {child: node for node in ast.walk(stmt) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(stmt):
            if not (isinstance(node, ast.Name) and node.id in (self._logits, _LOSS)):
                continue
            parent = parents.get(node)
            if isinstance(parent, (ast.keyword, ast.Tuple, ast.List)) or (
                    isinstance(parent, ast.Attribute) and parent.attr in _METADATA):
                continue
            if node.id == _LOSS and isinstance(parent, ast.Compare) and all(
                    isinstance(c, ast.Constant) and c.value is None for c in parent.comparators):
                continue
            return f"returns {_text(parent)}, which the replacement forward, returning {node.id} as computed, would not"
        return None

    @staticmethod
    def _known_loss_binding(stmt: ast.stmt) -> bool:
        """``loss = None``, or an added term (``loss += c * aux_loss``: models/loss_terms.py's part)."""
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and stmt.value.value is None:
            return True
        return adds_to_loss(stmt)

    def _loss_call(self, stmt: ast.stmt) -> ast.Call | None:
        """The ``self.loss_function(logits, labels, ...)`` call of ``loss = <that call>``, if that is the statement."""
        if not (isinstance(stmt, ast.Assign) and [_text(t) for t in stmt.targets] == [_LOSS]):
            return None
        call = stmt.value
        if not (isinstance(call, ast.Call) and _text(call.func) == "self.loss_function"):
            return None
        positional = [_text(a) for a in call.args]
        if positional[:2] != [self._logits, "labels"][:len(positional[:2])] or len(positional) > 3:
            return None
        for kw in call.keywords:
            if kw.arg is None and _text(kw.value) != "kwargs":
                return None
            if kw.arg is not None and (kw.arg not in _LOSS_KEYWORDS or
                                       (kw.arg == "logits" and _text(kw.value) != self._logits) or
                                       (kw.arg == "labels" and _text(kw.value) != "labels")):
                return None
        return call

    # -- running -----------------------------------------------------------------------------------
    def _compile(self, name: str, after: list[ast.stmt], kept: list[ast.stmt], var: str) -> Callable:
        """``name(self, var) -> var``: the ``kept`` statements under their ``if`` tests."""
        kept_ids = {id(s) for s in kept}
        pruned = _prune(after, kept_ids)
        bindings = [s for s in self._bindings if stores(s) & loads(pruned)]
        return compile_function(self._src, name, bindings + pruned + [parse_statement(f"return {var}")],
                                params=["self", var])

    def check(self, model: nn.Module) -> None:
        """ConfigError naming the first statement this model's config reaches that the replacement
        forward cannot reproduce, a non-scalar operand, or a loss function other than transformers'
        causal LM loss."""
        env = self._environment(model)
        for found in self._walk.refused:
            if self._reached(found.guards, env):
                raise ConfigError(f"{self.owner}: {found.text}; zero3d's tensor-parallel forward computes the logits "
                                  "on vocabulary shards and would not reproduce it")
        for expr, guards, var in self._walk.operands:
            if not self._reached(guards, env):
                continue
            value = self._value(expr, env)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise ConfigError(f"{self.owner}: {var} is combined with `{_text(expr)}`, a trainable tensor, whose "
                                  "gradient tensor parallelism would take from each rank's vocabulary slice alone")
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ConfigError(f"{self.owner}: {var} is combined with `{_text(expr)}`, a tensor of shape "
                                  f"{tuple(value.shape)}, which tensor parallelism cannot apply to a vocabulary shard")
        if self._walk.calls_loss_function:
            from transformers.loss.loss_utils import LOSS_MAPPING

            if model.loss_function is not LOSS_MAPPING.get("ForCausalLM"):
                raise ConfigError(f"{type(model).__name__}.loss_function is {model.loss_function!r}, not transformers' "
                                  "causal LM loss (ForCausalLMLoss), which zero3d's tensor-parallel forward computes "
                                  "on vocabulary shards")

    def _environment(self, model: nn.Module) -> dict[str, Any]:
        env: dict[str, Any] = {**self._src.globals, "self": model}
        for stmt in self._bindings:
            try:
                env[stmt.targets[0].id] = self._value(stmt.value, env)
            except Exception:  # noqa: BLE001 - a local this config cannot compute: its tests stay open
                continue
        return env

    @staticmethod
    def _value(expr: ast.expr, env: dict[str, Any]) -> Any:
        return eval(compile(ast.Expression(body=expr), "<head_program>", "eval"), env)  # noqa: S307 - the model's own code

    def _reached(self, guards: list[tuple[ast.expr, bool]], env: dict[str, Any]) -> bool:
        for test, branch in guards:
            try:
                if bool(self._value(test, env)) != branch:
                    return False
            except Exception:  # noqa: BLE001 - a test this config cannot evaluate may run
                continue
        return True


def _in_place(stmt: ast.stmt) -> bool:
    """A change of a tensor in place: ``x.mul_(2)``, ``torch.Tensor.fill_(x, 0)``, ``x.__imul__(2)``,
    ``x[...] = v`` or ``x.a = v`` (``self.<attr> = v`` aside)."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr = node.func.attr
            if (attr.endswith("_") and not attr.startswith("_")) or (attr.startswith("__i") and attr.endswith("__")):
                return True
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
                if any(isinstance(t, (ast.Subscript, ast.Attribute)) and _root(t) != "self" for t in elements):
                    return True
    return False


def _root(node: ast.expr) -> str | None:
    """The name under ``name.a[0].b``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _bound_value(stmt: ast.stmt, name: str) -> ast.expr | None:
    """The new value of ``name`` from ``name = v`` or ``name op= v`` (as ``name op v``), else None."""
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
        return ast.BinOp(left=ast.Name(id=name, ctx=ast.Load()), op=stmt.op, right=stmt.value)
    if isinstance(stmt, ast.Assign) and [_text(t) for t in stmt.targets] == [name]:
        return stmt.value
    return None


class _Replace(ast.NodeTransformer):
    """Replace one node (the head's call) by the logits' name."""

    def __init__(self, target: ast.AST, name: str) -> None:
        self.target = ast.unparse(target)
        self.name = name

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.Call) and ast.unparse(node) == self.target:
            return ast.copy_location(ast.Name(id=self.name, ctx=ast.Load()), node)
        return self.generic_visit(node)


def _copy(node: ast.expr) -> ast.expr:
    import copy

    return copy.deepcopy(node)


def _prune(stmts: list[ast.stmt], kept: set[int]) -> list[ast.stmt]:
    """``stmts`` with only the kept statements and the ``if`` statements around them."""
    out: list[ast.stmt] = []
    for stmt in stmts:
        if id(stmt) in kept:
            out.append(stmt)
        elif isinstance(stmt, ast.If):
            body, orelse = _prune(stmt.body, kept), _prune(stmt.orelse, kept)
            if body or orelse:
                out.append(ast.If(test=stmt.test, body=body or [ast.Pass()], orelse=orelse))
    return out


_CACHE: dict[tuple[type, str, str], HeadProgram] = {}


def head_program(model: nn.Module, base_attr: str) -> HeadProgram:
    """The (cached) :class:`HeadProgram` of ``type(model)``; ConfigError when its forward cannot be read."""
    head = model.get_output_embeddings()
    head_attr = next((n for n, m in model.named_children() if m is head), None)
    if head_attr is None:
        raise ConfigError(f"{type(model).__name__}'s output embeddings are not one of its own modules, so zero3d's "
                          "tensor-parallel forward cannot find the head in its forward")
    key = (type(model), base_attr, head_attr)
    if key not in _CACHE:
        try:
            _CACHE[key] = HeadProgram(type(model), base_attr, head_attr)
        except SourceError as exc:
            raise ConfigError(f"{exc}; zero3d's tensor-parallel forward must read what the forward does with the "
                              "logits") from None
    return _CACHE[key]
