"""Python literals in running text: where one ends, whether it is one, and its kind, for
reading a prompt's examples (examples.py). Any text goes in; nothing raises, nothing warns."""

from __future__ import annotations

import ast
import io
import re
import tokenize
import warnings


def closing(line: str, opening: int) -> int | None:
    """The index after the bracket that closes ``line[opening]``, skipping strings."""
    depth, quote, index = 0, "", opening
    while index < len(line):
        char = line[index]
        if quote:
            if char == "\\":
                index += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return None


def string_end(text: str) -> int | None:
    """The index after the string literal ``text`` starts with."""
    quote, index = text[0], 1
    while index < len(text):
        if text[index] == "\\":
            index += 2
            continue
        if text[index] == quote:
            return index + 1
        index += 1
    return None


def parse(source: str, mode: str = "eval") -> ast.AST | None:
    """``source`` parsed (an expression's body), or None for anything Python would not
    take: a prompt is any text, and a misfit must cost no exception and no warning."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source, mode=mode)
    except (SyntaxError, ValueError, UnicodeError, MemoryError, RecursionError):
        return None
    return tree.body if isinstance(tree, ast.Expression) else tree


def is_literal_node(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def is_literal(source: str) -> bool:
    """A Python literal, not a bare tuple (``3, which`` would read as ``(3,)``), and no
    comment (``7 # a note`` parses, as 7 and more)."""
    node = parse(source)
    if node is None or not is_literal_node(node):
        return False
    if "#" in source and _has_comment(source):
        return False
    return not (isinstance(node, ast.Tuple) and not source.startswith("("))


def _has_comment(source: str) -> bool:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return True
    return any(token.type == tokenize.COMMENT for token in tokens)


def literal_call(source: str) -> bool:
    """A call whose arguments are literals: ``f(a)`` in prose names no value."""
    call = parse(source)
    if not isinstance(call, ast.Call):
        return False
    return all(is_literal_node(arg) for arg in [*call.args, *(k.value for k in call.keywords)])


def arithmetic(source: str) -> bool:
    """Numbers and operators only: ``1 + (2 / 2)``."""
    tree = parse(source.strip())
    if tree is None:
        return False
    allowed = (ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    nodes = list(ast.walk(tree))
    return any(isinstance(n, ast.BinOp) for n in nodes) and all(
        isinstance(n, allowed) or (isinstance(n, ast.Constant) and isinstance(n.value, int | float))
        for n in nodes
    )


def kind(want: str) -> str:
    """The kind of a value, for telling a function's results from other numbers: numbers
    are one kind (2 and 2.0), sequences another; None goes with any."""
    node = parse(want)
    if node is None or not is_literal_node(node):
        return "other"
    value = ast.literal_eval(node)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float | complex):
        return "number"
    if isinstance(value, list | tuple):
        return "sequence"
    return type(value).__name__


def normal(source: str) -> str:
    node = parse(source.strip())
    if node is None:
        return source.strip()
    try:
        return ast.dump(node)
    except (ValueError, RecursionError):
        return source.strip()


def outside_strings(pattern: str, replacement: str, text: str) -> str:
    """``re.sub`` on the parts of ``text`` that are not string literals."""
    parts, start, index = [], 0, 0
    while index < len(text):
        if text[index] in "'\"":
            end = string_end(text[index:])
            if end is None:
                break
            parts.append(re.sub(pattern, replacement, text[start:index]))
            parts.append(text[index : index + end])
            index = start = index + end
        else:
            index += 1
    parts.append(re.sub(pattern, replacement, text[start:]))
    return "".join(parts)
