"""A static proof that a chat template is *content-blind*: that its rendering of plain messages (each a dict of
exactly `role` and a non-empty string `content`) is fixed text, set by the roles and the template kwargs alone,
interleaved with the contents written verbatim. For such a template, the rendering of a row equals the rendering
of the same roles with sentinel contents, each sentinel replaced by the row's content: rows of one shape can skip
Jinja and be built by substitution.

Why that is exact under the rules `content_blind` checks: the template's control flow and every text it writes
other than a content are computed from values that the shape fixes. Contents are read only where their value
cannot matter beyond being written: written whole by `{{ }}` (alone or as an operand of a `+`/`~` chain that is
itself the output, outside any block that could capture and transform the text: set-blocks, filter blocks, macros,
call blocks), or tested in a condition for their type (a str's type tests give the same answer for every str) or
their truthiness (always true: the shape's contents are non-empty). Messages and lists of messages reach nothing
but field reads by constant key (fields other than `content` are absent from the shape, so read as undefined),
indexing, iteration, `length`/`count`/`first`/`last` and type tests, so no filter, call, comparison or
assignment can see a content through a message. Bindings of names to messages are tracked to a fixed point,
every binding of a name counting everywhere (scoping ignored: more constraints, never fewer). Anything the
analysis does not know (another node type, a dict/list/str method name, `loop.previtem`, an impure global) makes
it answer False: a false False only costs a rendering, a false True would corrupt training text.
"""

from __future__ import annotations

import functools
from typing import Any

from jinja2 import nodes

_MSG, _LIST = "message", "list"
_NONE: frozenset[str] = frozenset()
VALUE, OUT, TEST, TYPE, MSGOK = range(5)  # how the parent uses a node (see _Checker.visit)

_TYPE_TESTS = frozenset({"string", "defined", "undefined", "none", "mapping", "iterable", "sequence", "number",
                         "boolean"})
_IMPURE = frozenset({"strftime_now", "random", "lipsum"})
_LOOP_ATTRS = frozenset({"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0",
                         "cycle", "changed"})  # not previtem/nextitem: they can be messages
_METHODS = frozenset(name for kind in (dict, list, str) for name in dir(kind))  # reached by getattr/getitem
_CAPTURING = (nodes.AssignBlock, nodes.FilterBlock, nodes.CallBlock, nodes.Macro)
_ALLOWED = (nodes.Template, nodes.Output, nodes.TemplateData, nodes.If, nodes.For, nodes.Assign, nodes.AssignBlock,
            nodes.With, nodes.FilterBlock, nodes.CallBlock, nodes.Macro, nodes.Continue, nodes.Break, nodes.Name,
            nodes.NSRef, nodes.Const, nodes.Tuple, nodes.List, nodes.Dict, nodes.Pair, nodes.Keyword,
            nodes.CondExpr, nodes.BinExpr, nodes.UnaryExpr, nodes.Concat, nodes.Compare, nodes.Operand,
            nodes.Filter, nodes.Test, nodes.Call, nodes.Getitem, nodes.Getattr, nodes.Slice,
            nodes.ExtensionAttribute)


class _Reject(Exception):
    """The template is not provably content-blind."""


@functools.lru_cache(maxsize=64)
def content_blind(template: str) -> bool:
    """Whether `template` provably writes each plain message's content only verbatim (see the module docstring),
    for messages of exactly `role` and a non-empty string `content` (truth tests of a content count on it being
    non-empty); False when unsure or when the template does not parse."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return False
    checker = _Checker(tree)
    try:
        checker.visit(tree)
    except (_Reject, RecursionError):
        return False
    return True


def _field_key(node: nodes.Node) -> str | None:
    """The constant string key of a field read, or None if `node` is not one."""
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        return node.value
    return None


def _is_get(node: nodes.Node) -> bool:
    """`X.get('key')` or `X.get('key', default)`, with a constant string key and nothing else passed."""
    return (isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and node.node.attr == "get"
            and 1 <= len(node.args) <= 2 and _field_key(node.args[0]) is not None
            and not (node.kwargs or node.dyn_args or node.dyn_kwargs))


def _safe_key(key: str | None) -> bool:
    """A key that reads a field: not a method of a dict, list or str (getattr/getitem would return the method)."""
    return key is not None and not key.startswith("_") and key not in _METHODS


class _Checker:
    """The binding analysis (`kind`) and the walk that rejects any use of content or messages not allowed."""

    def __init__(self, tree: nodes.Template) -> None:
        self.bindings: dict[str, frozenset[str]] = {"messages": frozenset({_LIST})}
        self.captured = 0
        self._bind(tree)

    def kind(self, node: nodes.Node) -> frozenset[str]:
        """What message values `node` may be: a message, a list of messages, both, or neither (empty)."""
        if isinstance(node, nodes.Name):
            return self.bindings.get(node.name, _NONE)
        if isinstance(node, nodes.Getitem) and _LIST in self.kind(node.node):
            return frozenset({_LIST if isinstance(node.arg, nodes.Slice) else _MSG})
        if (isinstance(node, nodes.Filter) and node.node is not None and node.name in ("first", "last")
                and _LIST in self.kind(node.node)):
            return frozenset({_MSG})
        return _NONE

    def _bind(self, tree: nodes.Template) -> None:
        """Every name bound (set, with, for) to a message or list of messages, iterated to a fixed point."""
        changed = True
        while changed:
            changed = False
            for node in tree.find_all((nodes.Assign, nodes.With, nodes.For)):
                if isinstance(node, nodes.Assign):
                    pairs = [(node.target, self.kind(node.node))]
                elif isinstance(node, nodes.With):
                    pairs = [(t, self.kind(v)) for t, v in zip(node.targets, node.values)]
                else:
                    pairs = [(node.target, frozenset({_MSG}) if _LIST in self.kind(node.iter) else _NONE)]
                for target, kind in pairs:
                    names = [target] if isinstance(target, nodes.Name) else list(target.find_all(nodes.Name))
                    for name in names:
                        old = self.bindings.get(name.name, _NONE)
                        if kind - old:
                            self.bindings[name.name] = old | kind
                            changed = True

    def is_content(self, node: nodes.Node) -> bool:
        """A read of a message's content: `X.content`, `X['content']`, `X.get('content')` with X a message."""
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and _MSG in self.kind(node.node)
        if isinstance(node, nodes.Getitem):
            return _field_key(node.arg) == "content" and _MSG in self.kind(node.node)
        return _is_get(node) and node.args[0].value == "content" and _MSG in self.kind(node.node.node)

    def visit(self, node: Any, ctx: int = VALUE) -> None:
        """Check `node`, used by its parent as `ctx`: VALUE (anything), OUT (the output, or a `+`/`~` chain that
        is), TEST (a condition's truth value), TYPE (the operand of a type test in a condition), MSGOK (a use
        allowed for a message or list of messages)."""
        if not isinstance(node, _ALLOWED):
            raise _Reject(type(node).__name__)
        if isinstance(node, nodes.Name) and (node.name in _IMPURE or (node.name == "loop" and node.ctx == "load")):
            raise _Reject(node.name)  # `loop` only as loop.index and the like (_visit_getattr)
        if isinstance(node, nodes.Name) and node.ctx != "load":
            return  # a name bound, not used
        if self.is_content(node):
            if not (ctx in (TEST, TYPE) or (ctx == OUT and not self.captured)):
                raise _Reject("content used")
            self._field_read(node)
        elif self.kind(node) and ctx not in (MSGOK, TEST):
            raise _Reject("message used")
        elif isinstance(node, _CAPTURING) and not _is_generation(node):
            self.captured += 1
            self._children(node)
            self.captured -= 1
        elif isinstance(node, (nodes.Add, nodes.Concat)) and ctx == OUT:
            self._children(node, OUT)
        elif isinstance(node, (nodes.And, nodes.Or, nodes.Not)) and ctx == TEST:
            self._children(node, TEST)
        else:
            self._visit_specific(node, ctx)

    def _children(self, node: nodes.Node, ctx: int = VALUE) -> None:
        for child in node.iter_child_nodes():
            self.visit(child, ctx)

    def _field_read(self, node: nodes.Node) -> None:
        """The message read by a field read (any key: checked by the caller), and a `.get` default."""
        base = node.node.node if isinstance(node, nodes.Call) else node.node
        self.visit(base, MSGOK)
        if isinstance(node, nodes.Call):
            for arg in node.args[1:]:
                self.visit(arg, VALUE)

    def _visit_specific(self, node: nodes.Node, ctx: int) -> None:
        """The nodes with rules of their own; any other node's children are visited as plain values."""
        if isinstance(node, nodes.Output):
            self._children(node, OUT)
        elif isinstance(node, nodes.If):
            self.visit(node.test, TEST)
            for child in [*node.body, *node.elif_, *node.else_]:
                self.visit(child)
        elif isinstance(node, nodes.CondExpr):
            self.visit(node.test, TEST)
            for child in (node.expr1, node.expr2):
                if child is not None:
                    self.visit(child)
        elif isinstance(node, nodes.For):
            self._visit_for(node)
        elif isinstance(node, (nodes.Assign, nodes.With)):
            self._visit_assign(node)
        elif isinstance(node, (nodes.Filter, nodes.Test)):
            self._visit_filter_test(node, ctx)
        elif isinstance(node, nodes.Getattr):
            self._visit_getattr(node)
        elif isinstance(node, nodes.Getitem):
            self._visit_getitem(node)
        elif _is_get(node) and _MSG in self.kind(node.node.node):
            self._visit_get(node)
        else:
            self._children(node)

    def _visit_for(self, node: nodes.For) -> None:
        """A list of messages may be iterated, into a plain name; a message may not (its keys)."""
        if self.kind(node.iter) == frozenset({_LIST}) and isinstance(node.target, nodes.Name):
            self.visit(node.iter, MSGOK)
        else:
            self.visit(node.iter)
        self.visit(node.target)
        if node.test is not None:
            self.visit(node.test, TEST)
        for child in [*node.body, *node.else_]:
            self.visit(child)

    def _visit_assign(self, node: nodes.Assign | nodes.With) -> None:
        """A message or list of messages may be set to a plain name, never to a namespace attribute or a tuple."""
        if isinstance(node, nodes.Assign):
            pairs, body = [(node.target, node.node)], []
        else:
            pairs, body = list(zip(node.targets, node.values)), node.body
        for target, value in pairs:
            message = bool(self.kind(value))
            if message and not isinstance(target, nodes.Name):
                raise _Reject("message set to a namespace or tuple")
            self.visit(target)
            self.visit(value, MSGOK if message else VALUE)
        for child in body:
            self.visit(child)

    def _visit_filter_test(self, node: nodes.Filter | nodes.Test, ctx: int) -> None:
        """Messages go to length/count/first/last and type tests; contents to type tests in conditions only."""
        if isinstance(node, nodes.Filter) and node.name == "random":
            raise _Reject("random")
        plain = not (node.args or node.kwargs or node.dyn_args or node.dyn_kwargs)
        operand = node.node
        if operand is not None:
            kind = self.kind(operand)
            if isinstance(node, nodes.Filter):
                allowed = plain and (node.name in ("length", "count") or (node.name in ("first", "last")
                                                                         and kind == frozenset({_LIST})))
                self.visit(operand, MSGOK if kind and allowed else VALUE)
            elif plain and node.name in _TYPE_TESTS:
                self.visit(operand, MSGOK if kind else TYPE if ctx == TEST else VALUE)
            else:
                self.visit(operand)
        for child in [*node.args, *node.kwargs, node.dyn_args, node.dyn_kwargs]:
            if child is not None:
                self.visit(child)

    def _visit_getattr(self, node: nodes.Getattr) -> None:
        kind = self.kind(node.node)
        if isinstance(node.node, nodes.Name) and node.node.name == "loop" and node.attr in _LOOP_ATTRS:
            return
        if kind and (_LIST in kind or not _safe_key(node.attr)):
            raise _Reject(f"attribute {node.attr} of a message or list")
        self.visit(node.node, MSGOK if kind else VALUE)

    def _visit_getitem(self, node: nodes.Getitem) -> None:
        """A message is indexed by a constant field name, a list of messages by anything but a string constant."""
        kind = self.kind(node.node)
        key = _field_key(node.arg)
        if _MSG in kind and not _safe_key(key):
            raise _Reject("message indexed by a non-constant key")
        if _LIST in kind and key is not None and not _safe_key(key):
            raise _Reject("list of messages indexed by a method name")
        self.visit(node.node, MSGOK if kind else VALUE)
        self.visit(node.arg)

    def _visit_get(self, node: nodes.Call) -> None:
        """`message.get('field'[, default])`, the field not `content` (a content read is checked as such)."""
        if _LIST in self.kind(node.node.node):
            raise _Reject("get on a list")
        self._field_read(node)


def _is_generation(node: nodes.Node) -> bool:
    """transformers' `{% generation %}` block: its body is written unchanged (the tracker only notes where)."""
    call = node.call if isinstance(node, nodes.CallBlock) else None
    return (isinstance(call, nodes.Call) and isinstance(call.node, nodes.ExtensionAttribute)
            and call.node.name == "_generation_support")
