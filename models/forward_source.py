"""Reading a Hugging Face ``forward`` as code: its statements, the names they read and write,
and new functions compiled from some of its statements.

The pipeline does not retype what a model's ``forward`` does around its blocks (masks per
layer type, rotary tables, embedding scales, logit soft-capping, ...); it cuts HF's own
``forward`` into pieces and runs each piece where it belongs (:mod:`models.stage_program`).
This module holds the generic tools for that. A compiled piece keeps the source file and line
numbers of the original, so a traceback points into the HF file, and runs with the globals of
the module that defines the method.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import importlib
import inspect
import textwrap
from typing import Any, Callable, Iterable

__all__ = [
    "MethodSource", "SourceError", "check_called_as_written", "compile_function", "fold_output_flags", "free_names",
    "is_validator", "loads", "mentions_self_attr", "method_source", "parse_statement", "stores",
]


class SourceError(Exception):
    """A forward the pipeline cannot cut; the message says why (the caller adds the family)."""


# transformers' own decorators of a ``forward``, which change nothing a piece of it computes:
# docstrings, tuple outputs when ``return_dict`` is off, flags filled from the config, outputs
# captured by hooks when asked for, renamed deprecated keyword arguments, accelerate's offload
# hooks fired early. (module, name); a name a transformers release lacks is left out.
_KNOWN_DECORATORS = (
    ("transformers.utils", "auto_docstring"), ("transformers.utils", "add_start_docstrings_to_model_forward"),
    ("transformers.utils", "replace_return_docstrings"), ("transformers.utils", "add_code_sample_docstrings"),
    ("transformers.utils.generic", "can_return_tuple"), ("transformers.utils.generic", "merge_with_config_defaults"),
    ("transformers.utils.generic", "check_model_inputs"), ("transformers.utils.output_capturing", "capture_outputs"),
    ("transformers.utils.deprecation", "deprecate_kwarg"),
    ("transformers.integrations.accelerate", "force_accelerate_hooks"),
)


@functools.lru_cache(1)
def _known_decorators() -> tuple[dict[int, str], frozenset[str]]:
    """({id of the decorator: its name}, the files their wrappers are defined in)."""
    found: dict[int, str] = {}
    files: set[str] = set()
    for module_name, name in _KNOWN_DECORATORS:
        try:
            obj = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        found[id(obj)] = name
        files.add(inspect.getsourcefile(obj) or "")
    return found, frozenset(files)


def _check_decorators(cls: type, name: str, owner: str, node: ast.FunctionDef, globals_: dict[str, Any]) -> None:
    """SourceError for a decorator zero3d would drop without knowing what it does: reading the
    method's statements skips whatever a decorator adds around them (``@torch.no_grad()``, a
    user's ``@scale_output``), both where it is written and where it is applied afterwards
    (``Model.forward = wrap(Model.forward)``)."""
    known, files = _known_decorators()
    allowed = ", ".join(sorted(set(known.values())))
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        try:
            obj = eval(compile(ast.Expression(body=target), "<decorator>", "eval"), globals_)  # noqa: S307 - a name
        except Exception:  # noqa: BLE001 - any failure to resolve it: unknown
            obj = None
        if obj is None or id(obj) not in known:
            raise SourceError(f"{owner} (line {deco.lineno}) is decorated with `@{ast.unparse(deco)}`, which zero3d "
                              f"does not run when it runs this forward's statements itself; allowed: transformers' "
                              f"{allowed}")
    layer = getattr(cls, name)
    while hasattr(layer, "__wrapped__"):
        code = getattr(layer, "__code__", None)
        where = code.co_filename if code is not None else type(layer).__qualname__
        if where not in files:
            wrapper = f"{code.co_qualname} ({where}:{code.co_firstlineno})" if code is not None else where
            raise SourceError(f"{owner} is wrapped by {wrapper}, which zero3d "
                              f"does not run when it runs this forward's statements itself; allowed: transformers' "
                              f"{allowed}")
        layer = layer.__wrapped__


class MethodSource:
    """The parsed source of one method (decorators and annotations dropped: only transformers'
    own, which change nothing the statements compute, are accepted)."""

    def __init__(self, cls: type, name: str) -> None:
        func = inspect.unwrap(getattr(cls, name))
        self.owner = f"{cls.__name__}.{name}"
        if func.__code__.co_freevars:
            raise SourceError(f"{self.owner} uses closure variables {func.__code__.co_freevars}")
        try:
            source = textwrap.dedent(inspect.getsource(func))
        except (OSError, TypeError) as exc:
            raise SourceError(f"the source of {self.owner} is not available ({exc})") from None
        tree = ast.parse(source)
        ast.increment_lineno(tree, func.__code__.co_firstlineno - 1)
        node = tree.body[0]
        if not isinstance(node, ast.FunctionDef):
            raise SourceError(f"{self.owner} is not a plain function")
        _check_decorators(cls, name, self.owner, node, func.__globals__)
        node.decorator_list = []
        node.returns = None
        for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg):
            if arg is not None:
                arg.annotation = None
        self.node = node
        self.globals: dict[str, Any] = func.__globals__
        self.filename = func.__code__.co_filename
        self.params = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
        self.params += [a.arg for a in (node.args.vararg, node.args.kwarg) if a is not None]
        self.body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        # Python's rule: a name bound anywhere in the function is local to all of it
        self.local_names = set(self.params) | stores(self.body)

    def is_global(self, name: str) -> bool:
        return name not in self.local_names and (name in self.globals or hasattr(builtins, name))


def check_called_as_written(module: Any, owner: str) -> None:
    """SourceError when calling ``module`` would do more than its class's ``forward``: code that
    runs the forward's statements itself (the pipeline's stage programs) never calls the module,
    so a ``forward`` set on the instance, a class ``__call__`` of its own, or forward hooks on
    it (or global ones) would be skipped. A replacement ``forward`` that marks itself with
    ``replaces_forward = True`` (tensor parallelism's, which has its own reader) is allowed."""
    from torch import nn
    from torch.nn.modules import module as module_globals

    what = f"{owner} ({type(module).__name__})"
    replaced = vars(module).get("forward")
    if replaced is not None:
        target = getattr(replaced, "__func__", replaced)
        target = getattr(target, "func", target)  # a functools.partial
        if not getattr(target, "replaces_forward", False):
            raise SourceError(f"{what} has a forward of its own set on the instance ({replaced!r}); zero3d runs the "
                              f"statements of {type(module).__name__}.forward. Subclass the model and override "
                              "forward instead")
    if type(module).__call__ is not nn.Module.__call__:
        raise SourceError(f"{what} overrides __call__, which zero3d does not call; it runs the statements of "
                          f"{type(module).__name__}.forward")
    hooks = {kind: getattr(module, kind, None) for kind in ("_forward_hooks", "_forward_pre_hooks")}
    hooks.update({f"global {kind}": getattr(module_globals, f"_global{kind}", None)
                  for kind in ("_forward_hooks", "_forward_pre_hooks")})
    found = sorted(kind for kind, table in hooks.items() if table)
    if found:
        raise SourceError(f"{what} has {', '.join(found)} registered; zero3d runs the statements of "
                          f"{type(module).__name__}.forward without calling the module, so they would not run. "
                          "Hooks on its submodules (blocks, norms, head) are fine")


def method_source(cls: type, name: str = "forward") -> MethodSource:
    """The parsed ``cls.<name>`` (the function under any decorators)."""
    return MethodSource(cls, name)


def _names(nodes: Iterable[ast.AST], ctx: type) -> set[str]:
    out: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ctx):
                out.add(sub.id)
    return out


def loads(nodes: ast.AST | Iterable[ast.AST]) -> set[str]:
    """Every name read anywhere in ``nodes``."""
    return _names([nodes] if isinstance(nodes, ast.AST) else nodes, ast.Load)


def stores(nodes: ast.AST | Iterable[ast.AST]) -> set[str]:
    """Every name bound anywhere in ``nodes`` (assignments, ``for`` targets, ``:=``)."""
    return _names([nodes] if isinstance(nodes, ast.AST) else nodes, ast.Store)


def free_names(stmts: list[ast.stmt], bound: Iterable[str] = ()) -> list[str]:
    """Names the statements read before binding them (statement by statement, in order; the
    branches of an ``if`` each in order, so a name bound and then read inside one is not free)."""
    bound = set(bound)
    free: list[str] = []
    for stmt in stmts:
        if isinstance(stmt, ast.If):
            new = (loads(stmt.test) - bound) | set(free_names(stmt.body, bound)) | set(free_names(stmt.orelse, bound))
        else:
            new = loads(stmt) - bound
        free += sorted(new - set(free))
        bound |= stores(stmt)
    return free


def is_validator(stmt: ast.stmt) -> bool:
    """``if <check>: raise ...`` with nothing else: input validation."""
    return (isinstance(stmt, ast.If) and not stmt.orelse
            and all(isinstance(s, ast.Raise) for s in stmt.body))


# Flags the pipeline fixes: it returns neither attentions nor per-layer hidden states, and
# reads the base model's output by field.
_FALSE_FLAGS = {"output_attentions", "output_hidden_states"}
_TRUE_FLAGS = {"return_dict"}


def _flag_test(test: ast.expr) -> bool | None:
    """The value of ``<flag>`` or ``not <flag>`` for a fixed flag, else None."""
    negate = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    name = test.operand if negate else test
    if not isinstance(name, ast.Name) or name.id not in _FALSE_FLAGS | _TRUE_FLAGS:
        return None
    return (name.id in _TRUE_FLAGS) != negate


def fold_output_flags(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """``stmts`` with every ``if output_attentions:``, ``if output_hidden_states:`` and ``if not
    return_dict:`` replaced by the branch that runs (older forwards collect attentions in tuples
    carried across the block loop and return tuples early; the pipeline needs neither)."""
    out: list[ast.stmt] = []
    for stmt in stmts:
        value = _flag_test(stmt.test) if isinstance(stmt, ast.If) else None
        if value is not None:
            out += fold_output_flags(stmt.body if value else stmt.orelse)
            continue
        for field in ("body", "orelse", "finalbody"):
            block = getattr(stmt, field, None)
            if block and isinstance(block, list) and not isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
                setattr(stmt, field, fold_output_flags(block) or [ast.Pass()])
        out.append(stmt)
    return out


def mentions_self_attr(stmt: ast.AST, attrs: set[str]) -> bool:
    """Whether ``stmt`` reads ``self.<a>`` for any ``a`` in ``attrs``."""
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
               and n.attr in attrs for n in ast.walk(stmt))


def _arguments(names: list[str]) -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in names], vararg=None, kwonlyargs=[],
                         kw_defaults=[], kwarg=None, defaults=[])


def compile_function(source: MethodSource, name: str, body: list[ast.stmt], params: list[str] | None = None,
                     extra_params: list[str] = ()) -> Callable:
    """A function made of ``body`` (statements of ``source``, or new ones).

    ``params=None`` keeps the method's own signature (defaults included) and adds
    ``extra_params`` as keyword-only parameters; otherwise the function takes ``params``.
    """
    if params is None:
        args = copy.deepcopy(source.node.args)
        args.kwonlyargs += [ast.arg(arg=n) for n in extra_params]
        args.kw_defaults += [None] * len(extra_params)
    else:
        args = _arguments(list(params))
    body = copy.deepcopy(body) or [ast.Pass()]
    line = source.node.lineno
    for stmt in body:  # statements written here take the line of the one before
        if getattr(stmt, "lineno", 0) < line:
            ast.increment_lineno(stmt, line - getattr(stmt, "lineno", line))
        line = getattr(stmt, "end_lineno", None) or line
    fn = ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None, type_params=[],
                         lineno=source.node.lineno, col_offset=0, end_lineno=line, end_col_offset=0)
    module = ast.Module(body=[fn], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace: dict[str, Any] = {}
    exec(compile(module, source.filename, "exec"), source.globals, namespace)  # noqa: S102 - HF's own code
    return namespace[name]


def is_call_of(node: ast.expr, path: str) -> bool:
    """Whether ``node`` calls ``self.<path>`` (``path`` may be dotted: ``model.decoder``)."""
    return isinstance(node, ast.Call) and ast.unparse(node.func) == f"self.{path}"


def assigned_name(stmt: ast.stmt) -> str | None:
    """The name ``stmt`` binds if it is ``name = ...`` or ``name: T = ...``."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
        return stmt.target.id
    return None


def calls_of(body: list[ast.stmt], paths: Iterable[str]) -> list[int]:
    """The indices of the statements of ``body`` that bind a name to a call of ``self.<path>``
    for one of ``paths`` (a causal LM's call of its base model)."""
    paths = list(paths)
    return [k for k, stmt in enumerate(body)
            if assigned_name(stmt) and any(is_call_of(stmt.value, p) for p in paths)]


def parse_statement(text: str) -> ast.stmt:
    """One statement written here (e.g. the ``return locals()`` that ends a piece)."""
    return ast.parse(text).body[0]
