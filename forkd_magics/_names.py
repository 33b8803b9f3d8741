"""What a ``%forkd`` argument names: a sandbox id, a snapshot tag, or a Python value.

Sandbox ids have one shape, ``sb-<hex>-<4 hex>`` (forkd's), so they are never Python identifiers. An
argument where a sandbox is expected is therefore an id when it has that shape, else Python: a
variable (``kids``), an expression (``kids[0]``, ``{kids[0].id}`` whose expansion failed); a name that
is not defined is Python's ``NameError``, not "sandbox kids not found". Where a snapshot is expected,
a bare word is a tag unless a variable of that name holds a ``Snapshot``.
"""

from __future__ import annotations

import ast

from IPython.core.error import UsageError

from forkd_server.client import Sandbox, Snapshot


def plainly(exc: BaseException) -> BaseException:
    """``exc`` shown as Python shows its type, on one line with no traceback of the magic (whose
    frames mean nothing to the user). Its type stays Python's own (a ``NameError``, a
    ``KeyboardInterrupt``), so a kernel reports the ``ename`` ipykernel would, and code that catches
    it by type still does."""
    exc._render_traceback_ = lambda: [f"\x1b[0;31m{type(exc).__name__}\x1b[0m: {exc}"]
    return exc


def undefined_name(message: str) -> NameError:
    """A ``%forkd`` argument names a variable that does not exist: Python's NameError, with what
    the argument may be instead."""
    return plainly(NameError(message))


def as_python(value, limit: int = 200) -> str | None:
    """``value`` as Python that means the same in a sandbox, or None: a sandbox by its id, a snapshot
    by its tag (lists of them as lists), a literal whose repr reads back equal and is short."""
    if isinstance(value, Sandbox):
        return repr(value.id)
    if isinstance(value, Snapshot):
        return repr(value.tag)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (Sandbox, Snapshot)) for v in value):
        return "[" + ", ".join(as_python(v) for v in value) + "]"
    try:
        text = repr(value)
        return text if len(text) <= limit and ast.literal_eval(text) == value else None
    except Exception:  # noqa: BLE001 - a repr that is no literal, or one that fails: nothing to paste
        return None


def _evaluate(token: str, ns: dict, where: str):
    """The value of ``token`` as Python in the user's namespace, or the token itself when it is
    not Python at all."""
    expr = token[1:-1].strip() if token.startswith("{") and token.endswith("}") else token
    if expr.isidentifier() and expr in ns:
        return ns[expr]
    try:
        code = compile(expr, "<%forkd argument>", "eval")
    except SyntaxError:
        return token
    try:
        return eval(code, ns)  # noqa: S307 - the user's own namespace, as IPython's {expr} expansion
    except NameError as exc:
        raise undefined_name(f"{exc}: {where}") from None
    except Exception as exc:  # noqa: BLE001 - the user's expression: say what it raised
        raise UsageError(f"forkd: {token} raised {type(exc).__name__}: {exc}") from None


def sandbox_ids(tokens: list[str], ns: dict, sub: str) -> list[str]:
    """Sandbox ids from ids, or from variables/expressions holding a Sandbox, an id or a list of them."""
    where = (f"%forkd {sub} takes sandbox ids (sb-…) or variables holding sandboxes "
             f"(e.g. kids = %forkd fork -t TAG -n 4)")
    ids: list[str] = []
    for token in tokens:
        value = token if token.startswith("sb-") else _evaluate(token, ns, where)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, Sandbox):
                ids.append(item.id)
            elif isinstance(item, str):
                ids.append(item)
            else:
                raise UsageError(f"forkd {sub}: {token} is a {type(item).__name__}, not a sandbox")
    return ids


def snapshot_tag(token: str, ns: dict, sub: str) -> str:
    """A tag, or the tag of the Snapshot a variable holds; a bare word that is no variable is a tag."""
    if token.startswith("{") and token.endswith("}"):  # an expansion that failed: Python's error
        value = _evaluate(token, ns, f"%forkd {sub} takes a snapshot tag or a variable holding a Snapshot")
        if isinstance(value, Snapshot):
            return value.tag
        raise UsageError(f"forkd {sub}: {token} is a {type(value).__name__}, not a snapshot")
    if isinstance(ns.get(token), Snapshot):
        return ns[token].tag
    return token  # a tag (tags hold '-' and '.', and a variable that is no Snapshot does not count)
