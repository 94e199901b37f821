"""Mutation operators: enumerate and apply small AST changes (spec/harness.md, HARN-2).

A mutant is one change at one AST node, identified by the node's index in a
deterministic ``ast.walk`` of the module, so the same source always gives the
same mutants in the same order (HARN-4). Only code that runs after import is
mutated: function and method bodies (patched by swapping ``__code__``) and
module-level assignments (tables such as the protocol rows, re-executed).
Strings, f-strings, annotations, docstrings and decorators are never mutated:
changes there are almost always equivalent or only change a message.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Mutant", "enumerate_mutants", "apply_mutant", "scope_of"]

_CMP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BIN: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_SWAP_NAMES = {"min": "max", "max": "min", "any": "all", "all": "any"}
#: modules-level statement kinds that are re-executed for a module-level mutant
MODULE_STMTS = (ast.Assign, ast.AnnAssign, ast.AugAssign)


@dataclass(frozen=True)
class Mutant:
    """One mutation: where (file:line:col), what (op, description), in which scope."""

    file: str  # path relative to the repository root
    line: int
    col: int
    end_line: int
    op: str
    description: str
    node_index: int  # index of the node in ast.walk(module)
    scope: str  # qualname of the outermost function/method, or "<module>:<stmt index>"

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.op}"


def _name(node: ast.AST) -> str:
    return type(node).__name__


def _sym(op: type[ast.AST]) -> str:
    return {
        "Lt": "<",
        "LtE": "<=",
        "Gt": ">",
        "GtE": ">=",
        "Eq": "==",
        "NotEq": "!=",
        "Is": "is",
        "IsNot": "is not",
        "In": "in",
        "NotIn": "not in",
        "Add": "+",
        "Sub": "-",
        "Mult": "*",
        "FloorDiv": "//",
        "Div": "/",
        "Mod": "%",
        "BitOr": "|",
        "BitAnd": "&",
        "LShift": "<<",
        "RShift": ">>",
        "And": "and",
        "Or": "or",
    }.get(op.__name__, op.__name__)


# an edit takes (node, parent, field, index-in-field) of the copy and changes it in place
Edit = Callable[[ast.AST, ast.AST, str, int | None], None]


def _replace(new: Callable[[ast.AST], ast.AST]) -> Edit:
    def edit(node: ast.AST, parent: ast.AST, fld: str, idx: int | None) -> None:
        repl = ast.copy_location(new(node), node)
        if idx is None:
            setattr(parent, fld, repl)
        else:
            getattr(parent, fld)[idx] = repl

    return edit


def _candidates(node: ast.AST, module_level: bool) -> Iterator[tuple[str, str, Edit]]:
    """(op, description, edit) for every mutation of ``node``."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            to = _CMP.get(type(op))
            if to is not None:

                def cmp_edit(n: ast.AST, *_: object, i: int = i, to: type = to) -> None:
                    assert isinstance(n, ast.Compare)
                    n.ops[i] = to()

                yield (
                    f"cmp{i}",
                    f"`{_sym(type(op))}` -> `{_sym(to)}`",
                    cmp_edit,
                )
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        tob = _BIN.get(type(node.op))
        if tob is not None:

            def bin_edit(n: ast.AST, *_: object, to: type = tob) -> None:
                n.op = to()  # type: ignore[attr-defined]

            yield (
                f"binop-{_name(node.op)}.{node.end_col_offset}",
                f"`{_sym(type(node.op))}` -> `{_sym(tob)}`",
                bin_edit,
            )
    elif isinstance(node, ast.BoolOp):
        to2: type[ast.boolop] = ast.Or if isinstance(node.op, ast.And) else ast.And

        def bool_edit(n: ast.AST, *_: object, to: type = to2) -> None:
            n.op = to()  # type: ignore[attr-defined]

        yield (
            f"boolop-{_name(node.op)}.{node.end_col_offset}",
            f"`{_sym(type(node.op))}` -> `{_sym(to2)}`",
            bool_edit,
        )
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.Invert)):
        yield f"unary-{_name(node.op)}", f"drop `{_name(node.op)}`", _replace(lambda n: n.operand)  # type: ignore[attr-defined]
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            yield "const", f"`{v}` -> `{not v}`", _replace(lambda n: ast.Constant(not v))
        elif isinstance(v, int):
            yield "const", f"`{v}` -> `{v + 1}`", _replace(lambda n: ast.Constant(v + 1))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        to3 = _SWAP_NAMES.get(node.func.id)
        if to3 is not None:

            def name_edit(n: ast.AST, *_: object, to: str = to3) -> None:
                n.func.id = to  # type: ignore[attr-defined]

            yield "call", f"`{node.func.id}(...)` -> `{to3}(...)`", name_edit
    elif isinstance(node, ast.List) and module_level and len(node.elts) > 1:
        for i in range(len(node.elts)):

            def drop_edit(n: ast.AST, *_: object, i: int = i) -> None:
                del n.elts[i]  # type: ignore[attr-defined]

            yield f"drop{i}", f"drop list element {i}", drop_edit
    if module_level:
        return
    if isinstance(node, ast.If) and not isinstance(node.test, ast.Constant):

        def neg_edit(n: ast.AST, *_: object) -> None:
            n.test = ast.copy_location(  # type: ignore[attr-defined]
                ast.UnaryOp(ast.Not(), n.test),  # type: ignore[attr-defined]
                n.test,  # type: ignore[attr-defined]
            )

        yield "negate", "negate the `if` condition", neg_edit
    elif isinstance(node, ast.Break):
        yield "stmt", "`break` -> `continue`", _replace(lambda n: ast.Continue())
    elif isinstance(node, ast.Continue):
        yield "stmt", "`continue` -> `break`", _replace(lambda n: ast.Break())
    elif isinstance(node, ast.Return) and node.value is not None:
        if not (isinstance(node.value, ast.Constant) and node.value.value is None):
            yield "stmt", "`return X` -> `return None`", _replace(lambda n: ast.Return(None))
    elif isinstance(node, ast.Raise):
        yield "stmt", "delete `raise`", _replace(lambda n: ast.Pass())
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield "stmt", "delete the call statement", _replace(lambda n: ast.Pass())


def _skipped_subtrees(fn: ast.AST) -> set[int]:
    """ids of nodes never mutated inside a function: annotations, docstrings, f-strings."""
    skip: set[int] = set()

    def mark(n: ast.AST | None) -> None:
        if n is not None:
            skip.update(id(x) for x in ast.walk(n))

    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        mark(fn.args)  # defaults run at import, not in the patched ``__code__``

    for n in ast.walk(fn):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = n.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None:
                    mark(a.annotation)
            if not isinstance(n, ast.Lambda):
                mark(n.returns)
                for d in n.decorator_list:
                    mark(d)
                body = n.body
                if (
                    body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                ):
                    mark(body[0])
        elif isinstance(n, ast.AnnAssign):
            mark(n.annotation)
        elif isinstance(n, (ast.JoinedStr, ast.Assert)):
            mark(n)
    return skip


def _scopes(tree: ast.Module) -> Iterator[tuple[str, ast.AST, bool]]:
    """(scope name, root node, module_level) for every mutable region of the module."""

    def in_class(cls: ast.ClassDef, prefix: str) -> Iterator[tuple[str, ast.AST, bool]]:
        for st in cls.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{st.name}", st, False
            elif isinstance(st, ast.ClassDef):
                yield from in_class(st, f"{prefix}{st.name}.")

    for i, st in enumerate(tree.body):
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield st.name, st, False
        elif isinstance(st, ast.ClassDef):
            yield from in_class(st, f"{st.name}.")
        elif isinstance(st, MODULE_STMTS):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names and not any(n.startswith("__") for n in names):
                yield f"<module>:{i}", st, True


def enumerate_mutants(source: str, relpath: str) -> list[Mutant]:
    """Every mutant of one module's source, in a deterministic order (HARN-2, HARN-4)."""
    tree = ast.parse(source)
    index = {id(n): i for i, n in enumerate(ast.walk(tree))}
    out: list[Mutant] = []
    for scope, root, module_level in _scopes(tree):
        skip = _skipped_subtrees(root)
        for node in ast.walk(root):
            if id(node) in skip or (node is root and not module_level):
                continue
            if module_level and isinstance(node, ast.AnnAssign):
                skip.update(id(x) for x in ast.walk(node.annotation))
            for op, desc, _ in _candidates(node, module_level):
                out.append(
                    Mutant(
                        file=relpath,
                        line=getattr(node, "lineno", 0),
                        col=getattr(node, "col_offset", 0),
                        end_line=getattr(node, "end_lineno", 0) or getattr(node, "lineno", 0),
                        op=op,
                        description=desc,
                        node_index=index[id(node)],
                        scope=scope,
                    )
                )
    return out


def apply_mutant(source: str, mutant: Mutant) -> ast.Module:
    """The module's AST with ``mutant`` applied (the original source is left unchanged)."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    target = nodes[mutant.node_index]
    parent_of: dict[int, tuple[ast.AST, str, int | None]] = {}
    for n in nodes:
        for fld, val in ast.iter_fields(n):
            if isinstance(val, list):
                for i, v in enumerate(val):
                    if isinstance(v, ast.AST):
                        parent_of[id(v)] = (n, fld, i)
            elif isinstance(val, ast.AST):
                parent_of[id(val)] = (n, fld, None)
    module_level = mutant.scope.startswith("<module>")
    for op, _, edit in _candidates(target, module_level):
        if op == mutant.op:
            parent, fld, idx = parent_of[id(target)]
            edit(target, parent, fld, idx)
            return ast.fix_missing_locations(tree)
    raise ValueError(f"mutant {mutant.id} does not apply to this source (code changed?)")


def scope_of(tree: ast.Module, scope: str) -> ast.AST:
    """The statement or function a scope name refers to."""
    for name, root, _ in _scopes(tree):
        if name == scope:
            return root
    raise KeyError(scope)


def mutated_copy(tree: ast.Module) -> ast.Module:
    return copy.deepcopy(tree)
