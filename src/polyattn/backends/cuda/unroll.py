"""Loops unrolled before Numba sees them: ``for i in unroll(N):``.

A GPU thread's small arrays (a patch of scores, a row of accumulators) stay in
registers only when every index into them is a compile-time constant, that is
when the loops over them are fully unrolled. LLVM unrolls small loops on its
own, but not loops with large bodies, and Numba has no ``#pragma unroll``; an
array indexed inside a loop that was left rolled goes to local memory, many
times slower. :func:`unrolled` rewrites a kernel's source instead: each
``for name in unroll(count):`` loop becomes ``count`` copies of its body with
``name`` replaced by the constants ``0 … count-1`` (``count`` is evaluated in
the kernel's namespace, so it may name a tile-size constant). Other loops are
left alone. Without :func:`unrolled`, ``unroll`` is ``range``, so the kernel
also runs as written (Numba's CUDA simulator runs the rewritten one too).

Examples
--------
>>> print(expand('''
... for i in unroll(N):
...     s[i] += x[i] * (i + 1)
... for j in range(M):
...     t[j] = 0
... ''', {"N": 2}))
s[0] += x[0] * (0 + 1)
s[1] += x[1] * (1 + 1)
for j in range(M):
    t[j] = 0
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

unroll = range


class _Substitute(ast.NodeTransformer):
    """Replaces reads of one name by a constant."""

    def __init__(self, name: str, value: int) -> None:
        self.name, self.value = name, value

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id == self.name:
            if not isinstance(node.ctx, ast.Load):
                raise SyntaxError(f"the unrolled loop assigns its variable {self.name!r}")
            return ast.copy_location(ast.Constant(self.value), node)
        return node


class _Unroll(ast.NodeTransformer):
    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace

    def visit_For(self, node: ast.For) -> Any:
        call = node.iter
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id == "unroll"):
            return self.generic_visit(node)
        if node.orelse or not isinstance(node.target, ast.Name) or len(call.args) != 1:
            raise SyntaxError("`for name in unroll(count):` takes one name, one count and "
                              "no else clause")
        count = eval(compile(ast.Expression(call.args[0]), "<unroll>", "eval"),
                     dict(self.namespace))
        body: list[ast.stmt] = []
        for value in range(int(count)):
            for stmt in node.body:
                expanded = _Substitute(node.target.id, value).visit(copy.deepcopy(stmt))
                body.append(expanded)
        # Loops nested in the copies (unroll or not) are visited in turn.
        out: list[Any] = []
        for stmt in body:
            visited = self.visit(stmt)
            out.extend(visited if isinstance(visited, list) else [visited])
        return out or [ast.copy_location(ast.Pass(), node)]


def _tree(fn: Callable[..., Any], namespace: dict[str, Any]) -> tuple[ast.Module, str, int]:
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    tree = _Unroll(namespace).visit(tree)
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, first - 1)
    return tree, inspect.getsourcefile(fn) or "<kernel>", first


def expand(source: str, namespace: dict[str, Any]) -> str:
    """``source`` with its ``unroll`` loops expanded (for reading)."""
    tree = _Unroll(namespace).visit(ast.parse(textwrap.dedent(source)))
    return ast.unparse(ast.fix_missing_locations(tree))


def unroll_source(fn: Callable[..., Any], namespace: dict[str, Any]) -> str:
    """The rewritten source of ``fn`` (for reading)."""
    return ast.unparse(_tree(fn, namespace)[0])


def unrolled(fn: Callable[..., Any], namespace: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with its ``unroll`` loops expanded, its free names looked up in
    ``namespace`` (the kernel factory's constants and functions, and the module's)."""
    tree, filename, _ = _tree(fn, namespace)
    scope = dict(namespace)
    scope.setdefault("unroll", unroll)
    exec(compile(tree, filename, "exec"), scope)
    new = scope[fn.__name__]
    new.__qualname__ = fn.__qualname__
    return new  # type: ignore[no-any-return]
