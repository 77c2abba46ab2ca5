"""A Hugging Face causal LM's own ``forward``, cut into the pieces pipeline stages run.

The base model's ``forward`` (``LlamaModel.forward``, ``GPT2Model.forward``, ...) is read as
source (:mod:`models.forward_source`) and cut at its one loop over the blocks:

* the **preamble** (everything before the loop: embedding, embedding scale or dropout, position
  ids, masks per layer type, rotary tables) runs on every stage. Stage 0 runs all of it on the
  micro-batch's ``input_ids``. A later stage runs it without the statements that compute the
  embeddings (those that bind ``inputs_embeds``/``hidden_states`` or call a first-stage module),
  with a :class:`~models.shape_guard.ShapeOnly` view of the received hidden states in place of
  ``inputs_embeds``: masks and rotary tables need only their shape, dtype and device;
* the **block step** (the loop body) runs for each of the stage's blocks, with the loop's
  index and block variables bound to the block's global index and module, so per-layer-type
  masks and rotary tables are looked up exactly as HF does;
* the **postamble** (the final norm and whatever follows the loop) runs on the last stage.

The causal LM's ``forward`` is cut at its call of the base model: the statements after it up to
the logits (``lm_head``, soft-capping, logit scales) run on the last stage; the loss statements
are replaced by the stage's loss function. What cannot be reproduced is refused when the
model is split (:class:`~models.forward_source.SourceError`): a value carried from block to
block other than the hidden states, blocks that read something computed from the embedding
values, a loss with terms beyond the token loss.
"""

from __future__ import annotations

import ast
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from models.forward_source import (
    SourceError, assigned_name, calls_of, compile_function, fold_output_flags, free_names, is_call_of, is_validator,
    loads, mentions_self_attr, method_source, parse_statement, stores,
)
from models.shape_guard import ShapeOnly, ValueRead, shape_only

__all__ = ["BaseProgram", "HeadProgram"]

_EMBEDDED = {"inputs_embeds", "hidden_states"}  # what stage 0 computes and a later stage receives
_FIRST_STAGE_INPUTS = {"input_ids", "inputs_embeds"}
_LOSS_NAMES = {"loss", "aux_loss"}
# arguments of the base model's call that are switches, not data: the pipeline fixes them
_FLAG_ARGUMENTS = {"use_cache", "output_attentions", "output_hidden_states", "return_dict", "output_router_logits"}
# the causal LM's arguments its statements after the base call may read: switches, and the
# logits to keep (training keeps all, the default)
_HEAD_MAY_READ = _FLAG_ARGUMENTS | {"self", "logits_to_keep", "num_logits_to_keep"}


def _line(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0]


def _iterates(node: ast.expr, attr: str) -> bool:
    """``self.<attr>``, ``self.<attr>[...]`` or ``enumerate`` of either."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate":
        return len(node.args) == 1 and not node.keywords and _iterates(node.args[0], attr)
    if isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
        and node.attr == attr


def _loop_targets(loop: ast.For, owner: str) -> tuple[str | None, str]:
    """(index variable or None, block variable) of the block loop."""
    target = loop.target
    enumerated = isinstance(loop.iter, ast.Call)
    if not enumerated and isinstance(target, ast.Name):
        return None, target.id
    if enumerated and isinstance(target, ast.Tuple) and len(target.elts) == 2 \
            and all(isinstance(e, ast.Name) for e in target.elts):
        return target.elts[0].id, target.elts[1].id
    raise SourceError(f"{owner} loops over its blocks as `{_line(loop.target)}`, which the pipeline does not read")


def _nested_continue(loop: ast.For) -> bool:
    """Whether a ``continue`` sits in a loop nested inside the block loop."""
    return any(isinstance(m, ast.Continue) for n in ast.walk(loop) if n is not loop and isinstance(n, (ast.For, ast.While))
               for m in ast.walk(n))


class _SkipBlock(ast.NodeTransformer):
    """``continue`` in the block loop's body becomes ``return hidden_states`` in the block step."""

    def visit_Continue(self, node: ast.Continue) -> ast.Return:
        return ast.copy_location(ast.Return(value=ast.Name(id="hidden_states", ctx=ast.Load())), node)


def _returns_hidden(ret: ast.Return) -> bool:
    value = ret.value
    if isinstance(value, ast.Call):
        return any(k.arg == "last_hidden_state" and isinstance(k.value, ast.Name) and k.value.id == "hidden_states"
                   for k in value.keywords)
    return False


def _contains_shape_only(value: Any) -> bool:
    if isinstance(value, ShapeOnly):
        return True
    if isinstance(value, (list, tuple)):
        return any(_contains_shape_only(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_shape_only(v) for v in value.values())
    return False


class _Probe:
    """Stands in for a block in the split-time check: records whether it was handed anything
    computed from the embeddings, returns the hidden states unchanged, and answers attribute
    reads (``decoder_layer.attention_type``) from the real block."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.embedded = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.embedded = _contains_shape_only(args) or _contains_shape_only(kwargs)
        return args[0] if args else kwargs["hidden_states"]


class BaseProgram:
    """The base model's forward as preamble / block step / postamble (module docstring)."""

    def __init__(self, base_cls: type, blocks_attr: str, first_attrs: set[str]) -> None:
        src = method_source(base_cls)
        self.owner = src.owner
        body = fold_output_flags(src.body)
        loops = [k for k, s in enumerate(body) if isinstance(s, ast.For) and _iterates(s.iter, blocks_attr)]
        if len(loops) != 1:
            raise SourceError(f"{self.owner} has {len(loops)} loops over self.{blocks_attr} at its top level; "
                              "the pipeline needs exactly one")
        k = loops[0]
        loop = body[k]
        if loop.orelse or any(isinstance(n, (ast.Break, ast.Return, ast.Yield, ast.Global, ast.Nonlocal))
                              for n in ast.walk(loop)) or _nested_continue(loop):
            raise SourceError(f"{self.owner}: the block loop has an else, break or return")
        loop.body = [_SkipBlock().visit(s) for s in loop.body]  # OPT's LayerDrop: `continue` skips a block
        if not (isinstance(body[-1], ast.Return) and _returns_hidden(body[-1])):
            raise SourceError(f"{self.owner} does not return `hidden_states` as its last_hidden_state")
        pre, post = body[:k], body[k + 1:-1]
        if any(isinstance(n, ast.Return) for n in ast.walk(ast.Module(body=pre + post, type_ignores=[]))):
            raise SourceError(f"{self.owner} returns early")
        if "inputs_embeds" not in src.params or "hidden_states" not in stores(pre):
            raise SourceError(f"{self.owner} takes no inputs_embeds or binds no hidden_states before its blocks")
        self.params = set(src.params)
        self.positional = [a.arg for a in (*src.node.args.posonlyargs, *src.node.args.args)]
        self.index_name, self.layer_name = _loop_targets(loop, self.owner)
        targets = {self.layer_name} | ({self.index_name} if self.index_name else set())

        later = [s for s in pre if not is_validator(s) and not stores(s) & _EMBEDDED
                 and not mentions_self_attr(s, first_attrs)]
        first_only = stores([s for s in pre if s not in later]) - _EMBEDDED - {"input_ids"}
        carried = set(free_names(loop.body)) & stores(loop.body) - {"hidden_states"}
        if carried:
            raise SourceError(f"{self.owner} carries {sorted(carried)} from one block to the next; only the hidden "
                              "states cross pipeline stages")
        if "hidden_states" not in stores(loop.body):
            raise SourceError(f"{self.owner}: the block loop does not bind hidden_states")
        leaked = set(free_names(post)) & (stores(loop.body) - targets - {"hidden_states"})
        if leaked:
            raise SourceError(f"{self.owner} reads {sorted(leaked)} from the last block after the loop")
        self.loop_line = f"line {loop.lineno}: `for {_line(loop.target)} in {_line(loop.iter)}`"
        self.sequence_names = sorted(loads(loop.iter) & src.local_names - {"self"})
        listed = parse_statement(f"return list({ast.unparse(loop.iter)})")
        self._sequence = compile_function(src, "pp_block_sequence", [listed], params=["self", *self.sequence_names])
        self.step_names = [n for n in free_names(loop.body)
                           if n in src.local_names and n not in targets and n != "hidden_states"]
        self.post_names = [n for n in free_names(post) if n in src.local_names and n != "hidden_states"]
        for name in self.step_names + self.post_names:
            if name in _FIRST_STAGE_INPUTS or name in first_only:
                raise SourceError(f"{self.owner}: the blocks or the final norm read {name!r}, which only the first "
                                  "stage computes (from the token ids or the embeddings)")
        done = parse_statement("return locals()")
        self._first = compile_function(src, "pp_first_stage_preamble", pre + [done])
        self._later = compile_function(src, "pp_later_stage_preamble",
                                       [parse_statement("hidden_states = inputs_embeds")] + later + [done])
        hidden = parse_statement("return hidden_states")
        self._step = compile_function(src, "pp_block_step", loop.body + [hidden],
                                      params=self.step_names + sorted(targets) + ["hidden_states"])
        self._post = compile_function(src, "pp_after_blocks", post + [hidden],
                                      params=self.post_names + ["hidden_states"])

    def prepare(self, base: nn.Module, first: bool, x: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor]:
        """The preamble's names and the hidden states entering the stage's first block.

        ``x`` is the micro-batch's ``input_ids`` on the first stage, the received hidden
        states on the others."""
        given = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
        if first:
            given["input_ids"] = x
        else:
            given["inputs_embeds"] = shape_only(x)
        ns = (self._first if first else self._later)(base, **{k: v for k, v in given.items() if k in self.params})
        return ns, ns["hidden_states"] if first else x

    def block(self, ns: dict[str, Any], index: int, layer: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Block ``index`` (global) on ``hidden``, called as the loop body calls it.

        SourceError when the step gives anything but hidden states like those it took (a tuple,
        ``layer_outputs[0]`` of a block that returns a tensor): the next stage receives them. The
        sequence dimension may change (sequence parallelism scatters it at the first block)."""
        out = self._run_step(ns, index, layer, hidden)
        if not _like_hidden(out, hidden):
            raise SourceError(f"{self.owner}: the block loop's body gives block {index}'s next hidden states as "
                              f"{_describe(out)} from hidden states of shape {tuple(hidden.shape)}; the pipeline "
                              "passes one tensor of shape (batch, sequence, hidden) from block to block")
        return out

    def _run_step(self, ns: dict[str, Any], index: int, layer: Any, hidden: torch.Tensor) -> Any:
        bound = {self.layer_name: layer, **({self.index_name: index} if self.index_name else {})}
        return self._step(**{n: ns[n] for n in self.step_names}, **bound, hidden_states=hidden)

    def finish(self, ns: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
        """What follows the blocks (the final norm): the base model's last hidden state."""
        out = self._post(**{n: ns[n] for n in self.post_names}, hidden_states=hidden)
        if not (isinstance(out, torch.Tensor) and out.dim() == hidden.dim() and out.shape[:2] == hidden.shape[:2]):
            raise SourceError(f"{self.owner}: what follows its block loop gives {_describe(out)} from hidden states "
                              f"of shape {tuple(hidden.shape)}; the pipeline needs a tensor of shape (batch, "
                              "sequence, width) as the last hidden state")
        return out

    def check(self, base: nn.Module, blocks: nn.ModuleList, hidden_size: int, dtype: torch.dtype,
              device: torch.device) -> None:
        """Run a later stage's preamble and every block step on a probe (no block computes):
        it must need nothing but the shape of the embeddings, and hand nothing derived from
        their values to a block."""
        x = torch.zeros(1, 2, hidden_size, dtype=dtype, device=device)
        try:
            ns, _ = self.prepare(base, False, x, None, None)
            self._check_sequence(base, ns, blocks)
            for index, block in enumerate(blocks):
                probe = _Probe(block)
                self._run_step(ns, index, probe, x)  # a probe returns what it took, not what its block returns
                if probe.embedded:
                    raise SourceError(f"{self.owner} hands block {index} a value computed from the embeddings, "
                                      "which only the first stage has")
            with torch.no_grad():
                self.finish(ns, x)
        except ValueRead as exc:
            raise SourceError(f"{self.owner} reads the values of the embeddings ({exc}) to prepare its blocks; a "
                              "later stage has only their shape") from None
        except (KeyError, NameError, AttributeError, TypeError, RuntimeError, ValueError) as exc:
            raise SourceError(f"{self.owner} cannot prepare a later stage's blocks without the embeddings "
                              f"({type(exc).__name__}: {exc})") from None


    def _check_sequence(self, base: nn.Module, ns: dict[str, Any], blocks: nn.ModuleList) -> None:
        """The loop must visit every block once, in order, with its index: each stage runs its
        own blocks by global index (``self.layers[::2]``, ``self.layers[1:]`` or a reversed order
        would be run as every block, in order)."""
        seq = self._sequence(base, **{n: ns[n] for n in self.sequence_names})
        if self.index_name is None:
            ok = len(seq) == len(blocks) and all(a is b for a, b in zip(seq, blocks))
        else:
            ok = len(seq) == len(blocks) and all(isinstance(e, tuple) and len(e) == 2 and e[0] == i and e[1] is b
                                                 for i, (e, b) in enumerate(zip(seq, blocks)))
        if not ok:
            raise SourceError(f"{self.owner} ({self.loop_line}) does not visit each of its {len(blocks)} blocks once, "
                              "in order" + ("" if self.index_name is None else ", with its index") + "; a pipeline "
                              "stage runs its share of all the blocks in order")


def _like_hidden(out: Any, hidden: torch.Tensor) -> bool:
    return (isinstance(out, torch.Tensor) and out.dim() == hidden.dim() == 3 and out.shape[0] == hidden.shape[0]
            and out.shape[-1] == hidden.shape[-1])


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _is_none_binding(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and stmt.value.value is None


def _is_token_loss(stmt: ast.stmt) -> bool:
    """``if labels is not None: loss = self.loss_function(...)``."""
    return (isinstance(stmt, ast.If) and not stmt.orelse and ast.unparse(stmt.test) == "labels is not None"
            and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Assign)
            and [ast.unparse(t) for t in stmt.body[0].targets] == ["loss"]
            and is_call_of(stmt.body[0].value, "loss_function"))


def _loss_logits(stmt: ast.If) -> str | None:
    """The name of the logits a token-loss statement hands to ``self.loss_function``."""
    call = stmt.body[0].value
    given = call.args[:1] + [k.value for k in call.keywords if k.arg == "logits"]
    return given[0].id if given and isinstance(given[0], ast.Name) else None


class HeadProgram:
    """The causal LM's forward after its base model: the logits (module docstring)."""

    def __init__(self, lm_cls: type, base_attr: str, inner: str = "", base_params: list[str] | None = None) -> None:
        """``base_attr``: the base model's attribute; ``inner``: the path under it of the module
        whose forward runs the blocks, which the causal LM may call directly (OPT's ``model.decoder``);
        ``base_params``: that forward's parameters in order (its positional arguments are checked)."""
        src = method_source(lm_cls)
        self.owner = src.owner
        body = fold_output_flags(src.body)
        paths = {base_attr} | ({f"{base_attr}.{inner}"} if inner else set())
        calls = calls_of(body, paths)
        if len(calls) != 1 or not isinstance(body[-1], ast.Return):
            raise SourceError(f"{self.owner} does not call self.{base_attr} once and then return")
        k = calls[0]
        outputs = assigned_name(body[k])
        keep, conditions = [], []
        logits = "logits"
        for stmt in body[k + 1:-1]:
            names = loads(stmt) | stores(stmt)
            if names & _LOSS_NAMES:
                if _is_token_loss(stmt):
                    logits = _loss_logits(stmt) or logits
                    continue
                if _is_none_binding(stmt):
                    continue
                if isinstance(stmt, ast.If) and "labels" not in loads(stmt.test):
                    conditions.append(stmt.test)
                    continue
                raise SourceError(f"{self.owner} computes its loss as `{_line(stmt)}`, which the pipeline does not "
                                  "reproduce")
            if "labels" in names:
                raise SourceError(f"{self.owner} uses the labels in `{_line(stmt)}`")
            keep.append(stmt)
        if logits not in stores(keep):
            raise SourceError(f"{self.owner} binds no `{logits}` after calling self.{base_attr}")
        self.conditions = [ast.unparse(t) for t in conditions]
        pre = body[:k]
        self._check_base_call(body[k], src, pre, base_params)
        self._check_inputs_read(keep, conditions, src, pre)
        self._logits = compile_function(src, "pp_head", pre + [parse_statement(f"{outputs} = pp_outputs")] + keep
                                        + [parse_statement(f"return {logits}")], extra_params=["pp_outputs"])
        tests = ast.Return(value=ast.List(elts=conditions, ctx=ast.Load()))
        self._conditions = compile_function(src, "pp_loss_conditions", pre + [tests])

    def _check_base_call(self, stmt: ast.stmt, src: Any, pre: list[ast.stmt], base_params: list[str] | None) -> None:
        """The base model must get the forward's own inputs, unchanged: a stage calls it with the
        micro-batch's (``self.model(input_ids=input_ids % 7)``, ``attention_mask=None`` or a mask
        computed before the call would be trained as if passed through)."""
        call = stmt.value
        rebound = stores(pre)
        varkw = src.node.args.kwarg.arg if src.node.args.kwarg else None
        allowed = (f"the forward's own parameters passed on unchanged under their own names (`input_ids=input_ids`,"
                   f" `**{varkw or 'kwargs'}`) and any value for {sorted(_FLAG_ARGUMENTS)}")

        def refuse(text: str) -> None:
            raise SourceError(f"{self.owner} (line {stmt.lineno}) passes its base model `{text}`; a pipeline stage "
                              f"calls the base model's pieces with the micro-batch's inputs. Allowed: {allowed}")

        positional = [p for p in (base_params or [])[1:]]
        for i, arg in enumerate(call.args):
            if not (isinstance(arg, ast.Name) and arg.id in src.params and arg.id not in rebound
                    and (base_params is None or (i < len(positional) and positional[i] == arg.id))):
                refuse(ast.unparse(arg))
        for kw in call.keywords:
            if kw.arg is None:
                if not (isinstance(kw.value, ast.Name) and kw.value.id == varkw and varkw not in rebound):
                    refuse(f"**{ast.unparse(kw.value)}")
            elif kw.arg not in _FLAG_ARGUMENTS and not (
                    isinstance(kw.value, ast.Name) and kw.value.id == kw.arg and kw.arg in src.params
                    and kw.arg not in rebound):
                refuse(f"{kw.arg}={ast.unparse(kw.value)}")

    def _check_inputs_read(self, keep: list[ast.stmt], conditions: list[ast.expr], src: Any,
                           pre: list[ast.stmt]) -> None:
        """The statements kept for the logits and the loss conditions run with the forward's
        defaults for its parameters (a stage has no ``input_ids`` or ``attention_mask`` to give
        them): refuse those that read one, directly or through a statement before the base call."""
        wanted = set(free_names(keep)) | loads(conditions)
        for stmt in reversed(pre):
            if stores(stmt) & wanted:
                wanted |= set(free_names([stmt]))
        read = sorted(wanted & set(src.params) - _HEAD_MAY_READ)
        if read:
            raise SourceError(f"{self.owner} computes its logits from its argument(s) {read} after calling its base "
                              f"model; a pipeline stage runs those statements without them. Allowed: "
                              f"{sorted(_HEAD_MAY_READ - {'self'})}")

    def logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the base model's last hidden state ``hidden``."""
        return self._logits(model, pp_outputs=BaseModelOutput(last_hidden_state=hidden))

    def check_logits(self, model: nn.Module, hidden: torch.Tensor) -> None:
        """The logits of ``hidden`` (a last hidden state of shape (batch, sequence, width)) must
        be one tensor of shape (batch, sequence, vocabulary): the stage's loss takes them as such."""
        with torch.no_grad():
            out = self.logits(model, hidden)
        if not (isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[:2] == hidden.shape[:2]):
            raise SourceError(f"{self.owner} gives its logits as {_describe(out)} for hidden states of shape "
                              f"{tuple(hidden.shape)}; the pipeline's loss takes one tensor of shape (batch, "
                              "sequence, vocabulary)")

    def check(self, model: nn.Module) -> None:
        """Refuse a model whose loss would add terms the last stage cannot compute (e.g. the
        router's auxiliary loss, which needs every block's router logits)."""
        for text, value in zip(self.conditions, self._conditions(model)):
            if value:
                raise SourceError(f"{self.owner} adds a term to the loss when `{text}` (true for this config); "
                                  "pipeline stages compute only the token loss")
