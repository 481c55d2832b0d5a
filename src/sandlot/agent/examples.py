"""The examples a prompt gives, as (call, expected) source pairs the sandbox can check.

Prompts write examples in many ways, and every example read is one more check that needs no
trust in the model: the samples are drawn when the first candidate fails one (sampling.py).
Read here:

- ``>>>`` doctests, with the expected value on the next line or in the line itself
  (``>>> f(x) == y``, a tenth of HumanEval);
- a call with literal arguments followed by a link and a literal, anywhere in a line:
  ``f(x) == y``, ``f(x) = y``, ``f(x) ➞ y``, ``f(x) -> y``, ``f(x) # => y``, and in words,
  ``f(x) returns y``, ``f(x) should be y``, ``f(x) is y``, as a sentence writes it
  ("For example, ``f([1, 2])`` returns 3.");
- inputs named rather than called, bound to the ``def``'s parameters: "For s = 'ab', c =
  'a' the result should be 'b'", "Given [1, 2] the function returns 3", and an "Input: ..."
  line followed by "Output: ...".

What keeps a misread out, since a prompt's example outranks every test the model writes:
the arguments must be literals (``f(n) = ...`` is a definition, not an example) that fill
the parameters in order; the expected value must be one literal ending where a clause can
end, so "f(2) is 4 times f(1)" gives nothing; a call given two different values gives
nothing; and when the values of ``f(x) = y`` lines have different kinds (``tri(1) = 3``
beside ``tri(3) = [1, 3, 2, 8]``: terms of a sequence beside the function's result) none of
those is kept. Every HumanEval prompt's examples read so hold for its canonical solution,
but for the three the dataset itself states wrongly (tests/test_agent_examples.py).
"""

from __future__ import annotations

import ast
import doctest
import io
import itertools
import re
import tokenize

# The link between a call and its value: symbols first, longest first ("==>" before "==").
_LINK = re.compile(
    r"""[ \t]*`?[ \t]*(?:\#[ \t]*)?
    (?P<link> ==> | == | => | -> | ➞ | → | =(?![=>])
      | (?: (?:should|would|will|must)[ \t]+(?:return|be|give|equal|yield|output)
          | returns | return | gives | equals | is | evaluates[ \t]+to | yields | outputs
        )(?!\w)
    )[ \t]*:?[ \t]*""",
    re.VERBOSE | re.IGNORECASE,
)
# What may follow a value where its clause ends: the line's end, punctuation, a
# parenthesised aside, a comment, or a word that starts another clause.
_CLAUSE_END = re.compile(
    r"[ \t]*(?:$|[.,;:!?)\]`]|\(|\#|(?:and|but|because|since|as|so|which|while|whereas|then|"
    r"for|if|when|where)\b)",
    re.IGNORECASE,
)
_WORDS = {"true": "True", "false": "False", "none": "None"}
# Bounds on the work a prompt can ask for (it is the caller's text, and a benchmark's task
# file anyone may write): a longer line is no example, and each line gets a few readings.
MAX_LINE_CHARS = 500
MAX_READINGS = 8  # argument lists tried per example, longest first
MAX_CALLS_PER_LINE = 8


def _lines(prompt: str) -> list[str]:
    return [line for line in prompt.splitlines() if len(line) <= MAX_LINE_CHARS]


def visible_examples(prompt: str, entry_point: str) -> list[tuple[str, str]]:
    """The prompt's examples of ``entry_point``: doctests first, then calls in the text, a
    call once (the first reading); see the module's docstring for what is read and what is
    refused."""
    pairs = _doctests(prompt, entry_point)
    inline = _inline(prompt, entry_point)
    defined = [(call, want) for call, want, link in inline if link == "="]
    if len({_kind(want) for _, want in defined} - {"none"}) > 1:
        inline = [found for found in inline if found[2] != "="]
    seen: dict[str, str] = {}
    conflicted: set[str] = set()
    read = [*pairs, *((call, want) for call, want, _ in inline)]
    params = _parameters(prompt, entry_point)
    if params is not None:
        read += _stated(prompt, entry_point, params)
    for call, want in read:
        key = _normal(call)
        if key in seen and _normal(seen[key]) != _normal(want):
            conflicted.add(key)
        seen.setdefault(key, want)
    out: list[tuple[str, str]] = []
    for call, want in read:
        key = _normal(call)
        if key not in conflicted and not any(_normal(c) == key for c, _ in out):
            out.append((call, want))
    return out


def _doctests(prompt: str, entry_point: str) -> list[tuple[str, str]]:
    """``>>>`` examples whose expected value is on the next line (the ``== y`` form is read
    with the calls in the text)."""
    try:
        examples = doctest.DocTestParser().get_examples(prompt)
    except ValueError:  # inconsistent indentation in a prompt: no usable doctests
        return []
    pairs = []
    for example in examples:
        want = [
            line for line in example.want.strip().splitlines() if line.strip() not in ('"""', "'''")
        ]
        if entry_point in example.source and want:
            pairs.append((example.source.strip(), "\n".join(want).strip()))
    return pairs


def _inline(prompt: str, entry_point: str) -> list[tuple[str, str, str]]:
    """(call, expected, the link between them) for each call followed by a value."""
    pairs = []
    calls = re.compile(rf"(?<![\w.]){re.escape(entry_point)}[ \t]*\(")
    for line in _lines(prompt):
        if line.lstrip().startswith(("def ", "async def ")):
            continue
        for found in itertools.islice(calls.finditer(line), MAX_CALLS_PER_LINE):
            end = _closing(line, found.end() - 1)
            if end is None:
                continue
            call = line[found.start() : end]
            link = _LINK.match(line, end)
            if link is None or not _literal_call(call):
                continue
            want = _value_at(line[link.end() :])
            if want is not None:
                pairs.append((call, want, link["link"]))
    return pairs


# "For num = "AB" the output should be 1.", "Given [1, 2] the function returns 3."
_STATED = re.compile(
    r"""\b(?:for|given|if|when|with)[ \t]+(?:the[ \t]+)?(?:inputs?[ \t]+)?(?P<args>\S.*?)
    [ \t]*,?[ \t]+(?:then[ \t]+)?(?:the[ \t]+)?
    (?: (?:output|result|answer|return(?:ed)?[ \t]+value)(?=[ \t]|:)
      | (?:function|it)[ \t]+(?:should[ \t]+|will[ \t]+|must[ \t]+)?returns?\b
    )(?P<tail>.*)$""",
    re.VERBOSE | re.IGNORECASE,
)
_INPUT = re.compile(
    r"^[ \t]*(?:example[ \t]*\d*[ \t]*:)?[ \t]*inputs?[ \t]*:[ \t]*(?P<args>\S.*)$", re.I
)
_OUTPUT = re.compile(r"^[ \t]*(?:output|result|returns?)[ \t]*:[ \t]*(?P<want>\S.*)$", re.I)


def _parameters(prompt: str, entry_point: str) -> tuple[list[str], int] | None:
    """``entry_point``'s parameter names from its ``def`` in the prompt, and how many of
    them need a value (those before the first default)."""
    found = re.search(
        rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", prompt, re.M
    )
    if found is None:
        return None
    end = _closing(prompt.replace("\n", " "), found.end() - 1)
    if end is None:
        return None
    try:
        tree = ast.parse(f"def _{prompt[found.end() - 1 : end]}: pass")
    except SyntaxError:
        return None
    arguments = tree.body[0].args  # type: ignore[attr-defined]
    if arguments.vararg or arguments.kwarg or arguments.kwonlyargs:
        return None
    names = [a.arg for a in [*arguments.posonlyargs, *arguments.args]]
    return names, len(names) - len(arguments.defaults)


def _stated(prompt: str, entry_point: str, params: tuple[list[str], int]) -> list[tuple[str, str]]:
    """Examples that name the inputs rather than write the call: "For s = "ab", c = "a"
    the result should be 'b'", and an "Input: ..." line followed by "Output: ..."."""
    pairs = []
    lines = _lines(prompt)
    for number, line in enumerate(lines):
        stated = _STATED.search(line)
        if stated:
            tail = stated["tail"]
            link = _LINK.match(tail)
            want = _value_at(tail[link.end() :] if link else tail)
            call = _bound(stated["args"], entry_point, params)
            if call is not None and want is not None:
                pairs.append((call, want))
            continue
        given = _INPUT.match(line)
        if not given:
            continue
        after = [later for later in lines[number + 1 : number + 3] if later.strip()]
        output = _OUTPUT.match(after[0]) if after else None
        want = _value_at(output["want"]) if output else None
        call = _bound(given["args"], entry_point, params)
        if call is not None and want is not None:
            pairs.append((call, want))
    return pairs


def _bound(text: str, entry_point: str, params: tuple[list[str], int]) -> str | None:
    """The call that ``text`` describes ("s = 'ab', k = 2", or literals in order), bound to
    the parameters, as source; the longest reading that ends at a comma."""
    names, required = params
    cuts = [len(text.rstrip(" \t.:,"))] + [i for i in range(len(text) - 1, 0, -1) if text[i] == ","]
    for cut in cuts[:MAX_READINGS]:
        try:
            call = ast.parse(f"_({text[:cut]})", mode="eval").body
        except SyntaxError:
            continue
        if not isinstance(call, ast.Call) or re.match(r"\s*\w+\s*=(?!=)", text[cut + 1 :]):
            continue  # a shorter reading that leaves out a named input is no reading
        values: dict[str, ast.expr] = dict(zip(names, call.args, strict=False))
        if len(call.args) > len(names):
            continue
        for keyword in call.keywords:
            if keyword.arg is None or keyword.arg not in names or keyword.arg in values:
                break
            values[keyword.arg] = keyword.value
        else:
            given = [name for name in names if name in values]
            if given != names[: len(given)] or len(given) < required:
                continue  # a gap: the values would land on the wrong parameters
            try:
                for value in values.values():
                    ast.literal_eval(value)
            except (ValueError, TypeError, MemoryError, RecursionError):
                continue
            return f"{entry_point}({', '.join(ast.unparse(values[n]) for n in given)})"
    return None


def _closing(line: str, opening: int) -> int | None:
    """The index after the parenthesis that closes ``line[opening]``, skipping strings."""
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


_SCALAR = re.compile(
    r"(?:[-+]?(?:\d[\d_]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?j?|true|false|none)(?!\w)",
    re.IGNORECASE,
)


def _value_at(text: str) -> str | None:
    """The literal ``text`` starts with, as source, when its clause ends there: a number or
    word (True, None), a string, or a bracketed value read to its closing bracket."""
    text = text.lstrip("`> \t")
    head, equals, rest = text.partition(" = ")
    if equals and _arithmetic(head):  # "1 + 9 = 10": the worked sum's result
        return _value_at(rest)
    if not text:
        return None
    end: int | None
    if text[0] in "([{":
        end = _closing(text, 0)
    elif text[0] in "'\"":
        end = _string_end(text)
    else:
        scalar = _SCALAR.match(text)
        end = scalar.end() if scalar else None
    if end is None or not _CLAUSE_END.match(text, end):
        return None
    source = _WORDS.get(text[:end].lower(), text[:end])
    return source if _is_literal(source) else None


def _string_end(text: str) -> int | None:
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


def _arithmetic(source: str) -> bool:
    """Numbers and operators only: ``1 + (2 / 2)``."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    return any(isinstance(n, ast.BinOp) for n in ast.walk(tree)) and all(
        isinstance(n, allowed) or (isinstance(n, ast.Constant) and isinstance(n.value, int | float))
        for n in ast.walk(tree)
    )


def _is_literal(source: str) -> bool:
    """A Python literal, and not a bare tuple (``3, which`` would read as ``(3,)``)."""
    try:
        node = ast.parse(source, mode="eval").body
        ast.literal_eval(node)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return False
    if "#" in source and _has_comment(source):
        return False  # "7 # a comment" parses, as 7 and more
    return not (isinstance(node, ast.Tuple) and not source.startswith("("))


def _has_comment(source: str) -> bool:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return True
    return any(token.type == tokenize.COMMENT for token in tokens)


def _literal_call(source: str) -> bool:
    """A call whose arguments are literals: ``f(a)`` in prose names no value."""
    try:
        call = ast.parse(source, mode="eval").body
    except SyntaxError:
        return False
    if not isinstance(call, ast.Call):
        return False
    try:
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            ast.literal_eval(arg)
    except (ValueError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _kind(want: str) -> str:
    """The kind of a value, for telling a function's results from other numbers: numbers
    are one kind (2 and 2.0), sequences another; None goes with any."""
    value = ast.literal_eval(want)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float | complex):
        return "number"
    if isinstance(value, list | tuple):
        return "sequence"
    return type(value).__name__


def _normal(source: str) -> str:
    try:
        return ast.dump(ast.parse(source.strip(), mode="eval"))
    except SyntaxError:
        return source.strip()
