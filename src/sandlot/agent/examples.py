"""The examples a prompt gives, as (call, expected) source pairs the sandbox can check.

Prompts write examples in many ways, and every example read is one more check that needs no
trust in the model: the samples are drawn when the first candidate fails one (sampling.py).
Read here:

- ``>>>`` doctests, with the expected value on the next line or in the line itself
  (``>>> f(x) == y``, a tenth of HumanEval);
- a call with literal arguments followed by a link and a literal, anywhere in a line:
  ``f(x) == y``, ``f(x) = y``, ``f(x) ➞ y``, ``f(x) -> y``, ``f(x) # => y``, and in words,
  ``f(x) returns y``, ``f(x) should be y``, ``f(x) is y``, as a sentence writes it
  ("For example, ``f([1, 2])`` returns 3."); ``assert f(x) == y, "message"``,
  ``test.assert_equals(f(x), y)``, ``f(x)  # return y``;
- inputs named rather than called, bound to the ``def``'s parameters: "For s = 'ab', c =
  'a' the result should be 'b'", "If x is 4, the result is 8", "Given 2 and 3 the function
  returns 5", and an "Input: ..." line followed by (or ending in) "Output: ...".

A prompt's example outranks every test the model writes, so a misread costs more than a
miss, and these are refused: arguments that are not literals (``f(n) = ...`` is a
definition) or that would not fill the parameters in order, or leave out an input the text
names ("with a shift of 3"); a call that is an operand (``fib(3) + fib(2) = 3``); a value
that is not one literal ending its clause ("4 times f(1)", "2, 3, 5, 7", "0.333...",
"5! = 120"); a sentence that asks, or takes the value back ("but", "instead", "would",
"naive"); a call given two values; ``f(x) = y`` values of mixed kinds, or of a kind no
other example gives (``tri(1) = 3`` beside ``tri(3) = [1, 3, 2, 8]``: a sequence's terms
beside the function's result); any value but None for a function that returns nothing
(``-> None``, "in place"); a doctest of ``print(...)`` or one that raises. Every HumanEval
prompt's examples read so hold for its canonical solution, but for the three the dataset
itself states wrongly (tests/test_agent_examples.py).
"""

from __future__ import annotations

import ast
import doctest
import itertools
import re

from sandlot.agent.literals import (
    arithmetic,
    closing,
    is_literal,
    is_literal_node,
    kind,
    literal_call,
    normal,
    outside_strings,
    parse,
    string_end,
)

# The link between a call and its value: symbols first, longest first ("==>" before "==").
# No bare "return" or "would": "Does f(3) return 6?", "would make f([]) return None".
_LINK = re.compile(
    r"""[ \t]*`?[ \t]*(?:\#[ \t]*)?
    (?P<link> ==> | --> | == | => | -> | ➞ | → | ⇒ | =(?![=>])
      | (?: (?:should|will|must)[ \t]+(?:return|be|give|equal|yield|output)
          | is[ \t]+expected[ \t]+to[ \t]+(?:return|be)
          | returns | gives | equals | is | evaluates[ \t]+to | yields | outputs | produces
        )(?!\w)
    )[ \t]*:?[ \t]*""",
    re.VERBOSE | re.IGNORECASE,
)
# What may follow a value where its clause ends: the line's end, a full stop (not "..."),
# a comma, a parenthesised aside, a comment, a word that starts another clause, or a dash
# before words ("6 - the sum of 1, 2 and 3"; not "6 - 1"). Not "!"
# ("5! = 120"), "?" (a question), "if" or "when" (a value under a condition), "as" ("42 as
# a string").
_CLAUSE_END = re.compile(
    r"[ \t]*(?:$|\.(?!\.)|[,;:)\]`(\#]|(?:and|because|since|so|which|while|whereas|then|"
    r"for|where)\b|(?:-{1,2}|\u2014|\u2013)[ \t]+(?=[a-z]))",
    re.IGNORECASE,
)
# Words that make a value in their sentence something other than the function's result.
_NOT_SO = re.compile(
    r"\b(?:but|however|instead|otherwise|wrong|incorrect\w*|naive\w*|would|could|might|"
    r"mistake\w*|bug\w*)\b",
    re.IGNORECASE,
)
# A prompt saying the function returns nothing: its examples show the argument afterwards.
# ("Return None if ..." is a result, not this.)
_RETURNS_NOTHING = re.compile(
    r"in[- ]place|do(?:es)?(?: not|n't) return|returns? nothing",
    re.IGNORECASE,
)
_WORDS = {"true": "True", "false": "False", "none": "None"}
_SCALAR = re.compile(
    r"(?:[-+]?(?:\d[\d_]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?j?|true|false|none)(?!\w)",
    re.IGNORECASE,
)
# A further value after a comma or "and": "2, 3, 5", "1,000", "[1], [2]", "3 and 1".
_MORE = re.compile(r"\s*(?:,|,?\s+and\b)\s*(?:[-+]?\.?\d|['\"\[({])")
# Bounds on the work a prompt can ask for (it is the caller's text, and a benchmark's task
# file anyone may write): a longer line is no example, and each line gets a few readings.
MAX_LINE_CHARS = 500
MAX_READINGS = 8  # argument lists tried per example, longest first
MAX_CALLS_PER_LINE = 8

Pair = tuple[str, str]
Signature = tuple[list[str], int, bool]  # parameter names, how many need a value, -> None


def visible_examples(prompt: str, entry_point: str) -> list[Pair]:
    """The prompt's examples of ``entry_point``: doctests first, then calls in the text,
    then inputs named in the text; a call once; see the module's docstring for what is read
    and what is refused."""
    signature = _signature(prompt, entry_point)
    doctests = _doctests(prompt, entry_point)
    inline = _inline(prompt, entry_point, signature)
    stated = _stated(prompt, entry_point, signature) if signature else []
    # "f(x) = y" lines are often a definition's terms: kept only where their values are of
    # one kind, and of a kind the other examples also give.
    defined = {kind(want) for _, want, link in inline if link == "="} - {"none"}
    others = [*doctests, *((c, w) for c, w, link in inline if link != "="), *stated]
    elsewhere = {kind(want) for _, want in others} - {"none"}
    if len(defined) > 1 or (defined and elsewhere and not defined <= elsewhere):
        inline = [found for found in inline if found[2] != "="]
    read = [*doctests, *((call, want) for call, want, _ in inline), *stated]
    if (signature and signature[2]) or _RETURNS_NOTHING.search(prompt):
        read = [(call, want) for call, want in read if want == "None"]
    keyed = [(normal(call), call, want) for call, want in read]
    values: dict[str, set[str]] = {}
    for key, _, want in keyed:
        values.setdefault(key, set()).add(normal(want))
    out: dict[str, Pair] = {}
    for key, call, want in keyed:
        if len(values[key]) == 1:  # a call given two different values gives nothing
            out.setdefault(key, (call, want))
    return list(out.values())


def _doctests(prompt: str, entry_point: str) -> list[Pair]:
    """``>>>`` examples of an expression with the expected value on the next line (the
    ``== y`` form is read with the calls in the text). Not ``print(...)``, whose value is
    None, nor a traceback."""
    try:
        examples = doctest.DocTestParser().get_examples(prompt)
    except ValueError:  # inconsistent indentation in a prompt: no usable doctests
        return []
    quotes = ('"""', "'''")
    pairs = []
    for example in examples:
        source = example.source.strip()
        lines = example.want.strip().splitlines()
        want = "\n".join(line for line in lines if line.strip() not in quotes).strip()
        if not want or entry_point not in source:
            continue
        if max(len(source), len(want)) > MAX_LINE_CHARS or want.startswith("Traceback"):
            continue
        node = parse(source)
        printed = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "print"
        if node is not None and not printed:
            pairs.append((source, want))
    return pairs


def _inline(
    prompt: str, entry_point: str, signature: Signature | None
) -> list[tuple[str, str, str]]:
    """(call, expected, the link between them) for each call followed by a value."""
    pairs = []
    calls = re.compile(rf"(?<![\w.]){re.escape(entry_point)}[ \t]*\(")
    for line in _lines(prompt):
        if line.lstrip().startswith(("def ", "async def ")):
            continue
        for found in itertools.islice(calls.finditer(line), MAX_CALLS_PER_LINE):
            before = line[: found.start()].rstrip()
            operand = before[-1:] in set("+-*/%@&|^<>=") and before[:-1].strip()
            if operand and not before.endswith(">>>"):
                continue  # "fib(3) + fib(2) = 3": a part of the expression, not all of it
            end = closing(line, found.end() - 1)
            if end is None:
                continue
            call = line[found.start() : end]
            if not literal_call(call) or _NOT_SO.search(_last_sentence(before)):
                continue
            if _ASSERT_EQUAL.search(before):  # test.assert_equals(f(4), 8)
                comma = re.match(r"[ \t]*,[ \t]*", line[end:])
                asserted = _read_value(line[end + comma.end() :]) if comma else None
                if asserted is not None and re.match(r"[ \t]*\)", asserted[1]):
                    pairs.append((call, asserted[0], "assert"))
                continue
            link = _LINK.match(line, end) or _COMMENT_RETURN.match(line, end)
            if link is None:
                continue
            text = line[link.end() :]
            if before.lstrip() == "assert":  # "assert f(-1) == 1, 'negative'": its message
                text = re.sub(r",[ \t]*[fr]?['\"].*$", "", text)
            read = _read_value(text)
            if read is None:
                continue
            want, after = read
            after = after.split(f"{entry_point}(", 1)[0]  # up to the next example's call
            if signature is None or not _conditional(
                after, signature[0], _arity(call) >= len(signature[0])
            ):
                pairs.append((call, want, link["link"]))
    return pairs


def _arity(call: str) -> int:
    node = parse(call)
    return len(node.args) + len(node.keywords) if isinstance(node, ast.Call) else 0


_ASSERT_EQUAL = re.compile(r"\bassert_?equals?[ \t]*\([ \t]*$|\bassertEqual[ \t]*\([ \t]*$", re.I)
# "f(4)  # return 8": a bare "return" reads as an example only in a comment after the call.
_COMMENT_RETURN = re.compile(r"[ \t]*\#[ \t]*(?P<link>return)[ \t]+", re.I)


# "For num = "AB" the output should be 1.", "Given [1, 2] the function returns 3."
_LEAD = re.compile(r"\b(?:for|given|if|when|with)\b", re.IGNORECASE)
_STATED = re.compile(
    r"""(?:for|given|if|when|with)[ \t]+
    (?:(?:the[ \t]+)?inputs?[ \t]+(?:is[ \t]+)?|called[ \t]+with[ \t]+)?(?P<args>\S.*?)
    [ \t]*,?[ \t]+(?:then[ \t]+)?(?:the[ \t]+)?
    (?: (?:output|result|answer|return(?:ed)?[ \t]+value)(?=[ \t]|:)
      | (?:function|it)[ \t]+(?:should[ \t]+|will[ \t]+|must[ \t]+)?returns?\b
    )(?P<tail>.*)$""",
    re.VERBOSE | re.IGNORECASE,
)
_INPUT = re.compile(r"^[ \t]*(?:example[ \t]*\d*[ \t]*:)?[ \t]*inputs?[ \t]*:(?P<args>.*)$", re.I)
# "Input: 5 -> Output: 120" on one line.
_OUTPUT_AFTER = re.compile(r"(?:,|->|=>|→)?[ \t]*\b(?:output|result)[ \t]*:", re.I)
# "Input: [1, 2, 3] (three numbers)": an aside in words after the input.
_ASIDE = re.compile(r"[ \t]\(([^()]*)\)[ \t]*$")
_OUTPUT = re.compile(r"^[ \t]*(?:output|result|returns?)[ \t]*:[ \t]*(?P<want>\S.*)$", re.I)


def _signature(prompt: str, entry_point: str) -> Signature | None:
    """``entry_point``'s parameter names from its ``def`` in the prompt, how many of them
    need a value (those before the first default), and whether it is annotated ``-> None``."""
    found = re.search(
        rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", prompt, re.M
    )
    if found is None:
        return None
    header = prompt[found.end() - 1 : found.end() - 1 + 4 * MAX_LINE_CHARS]
    end = closing(header.replace("\n", " "), 0)
    if end is None:
        return None
    tree = parse(f"def _{header[:end]}: pass", mode="exec")
    if not isinstance(tree, ast.Module) or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    arguments = tree.body[0].args
    if arguments.vararg or arguments.kwarg or arguments.kwonlyargs:
        return None
    names = [a.arg for a in [*arguments.posonlyargs, *arguments.args]]
    returns = re.match(r"\s*->\s*([^:]*):", header[end:])
    nothing = returns is not None and returns.group(1).strip() == "None"
    return names, len(names) - len(arguments.defaults), nothing


def _stated(prompt: str, entry_point: str, signature: Signature) -> list[Pair]:
    """Examples that name the inputs rather than write the call: "For s = "ab", c = "a"
    the result should be 'b'", and an "Input: ..." line followed by "Output: ..."."""
    pairs = []
    lines = _lines(prompt)
    for number, line in enumerate(lines):
        for lead in itertools.islice(_LEAD.finditer(line), MAX_CALLS_PER_LINE):
            stated = _STATED.match(line, lead.start())
            if not stated or _NOT_SO.search(_last_sentence(line[: lead.start()])):
                continue
            found = _stated_at(stated, entry_point, signature)
            if found is None:
                continue
            (call, complete), (want, after) = found
            # "15 when k = 3": words after the value are a condition on it, unless they
            # start the next example ("6, and for n = 0 the answer is 1").
            leads = itertools.islice(_LEAD.finditer(after), MAX_CALLS_PER_LINE)
            nxt = next(
                (
                    m
                    for m in leads
                    if _stated_at(_STATED.match(after, m.start()), entry_point, signature)
                ),
                None,
            )
            if not _conditional(after[: nxt.start()] if nxt else after, signature[0], complete):
                pairs.append((call, want))
        given = _INPUT.match(line)
        if not given:
            continue
        args, read = given["args"], None
        inline_output = _OUTPUT_AFTER.search(args)
        if inline_output:  # "Input: 5 -> Output: 120" on one line
            args, read = args[: inline_output.start()], _read_value(args[inline_output.end() :])
        else:
            below = [later for later in lines[number + 1 : number + 3] if later.strip()]
            output = _OUTPUT.match(below[0]) if below else None
            read = _read_value(output["want"]) if output else None
        bound = _bound(_without_aside(args.strip(), signature[0]), entry_point, signature)
        if bound is not None and read is not None:
            (call, complete), (want, after_value) = bound, read
            if not _conditional(after_value, signature[0], complete):
                pairs.append((call, want))
    return pairs


def _without_aside(text: str, names: list[str]) -> str:
    """``text`` less a parenthesised aside in words at its end ("(three numbers)"); an
    aside holding a value or a parameter ("(with k = 2)", "('c', 'd')") stays, and refuses
    the reading."""
    aside = _ASIDE.search(text)
    if aside is None:
        return text
    inner = aside.group(1)
    if (
        re.search(r"[=\d'\"]", inner)
        or _names_any(inner, names)
        or not re.search(r"[a-z]", inner, re.I)
    ):
        return text
    return text[: aside.start()]


def _stated_at(
    stated: re.Match[str] | None, entry_point: str, signature: Signature
) -> tuple[Bound, tuple[str, str]] | None:
    """The call and value a ``_STATED`` match reads, if both read."""
    if stated is None:
        return None
    tail = stated["tail"]
    link = _LINK.match(tail)
    read = _read_value(tail[link.end() :] if link else tail)
    bound = _bound(stated["args"], entry_point, signature)
    return (bound, read) if bound is not None and read is not None else None


Bound = tuple[str, bool]  # the call's source, and whether every parameter was given


def _bound(text: str, entry_point: str, signature: Signature) -> Bound | None:
    """The call that ``text`` describes ("s = 'ab', k = 2", or literals in order; else "x
    is 4", "2 and 3"), bound to the parameters. The rewrites stay outside string literals."""
    names = signature[0]
    call = _bound_reading(text, entry_point, signature)
    if call is None and names:  # "If x is 4": a parameter named, then its value
        named = "|".join(re.escape(name) for name in names)
        text = outside_strings(rf"\b({named})[ \t]+is[ \t]+", r"\1 = ", text)
        call = _bound_reading(text, entry_point, signature)
    if call is None and re.search(r"[ \t]+and[ \t]+", text):
        # "Given 2 and 3": one value for each parameter, all of them, or no reading.
        listed = outside_strings(r",?[ \t]+and[ \t]+", ", ", text.rstrip(" \t.:,"))
        parsed = parse(f"_({listed})")
        if isinstance(parsed, ast.Call) and len(parsed.args) + len(parsed.keywords) == len(names):
            call = _bound_reading(listed, entry_point, signature)
    return call


def _bound_reading(text: str, entry_point: str, signature: Signature) -> Bound | None:
    """The whole text bound to the parameters, or its longest part before a comma when what
    follows names no further input."""
    names, required, _ = signature
    cuts = [len(text.rstrip(" \t.:,"))]
    cuts += [i for i in range(len(text) - 1, 0, -1) if text[i] == ","]
    for cut in cuts[:MAX_READINGS]:
        dropped = text[cut:]
        if _MORE.match(dropped) or re.match(r"\s*,\s*\w+\s*=(?!=)", dropped):
            return None  # a further value or named input: this reading would leave it out
        call = parse(f"_({text[:cut]})")
        if not isinstance(call, ast.Call) or len(call.args) > len(names):
            continue
        values: dict[str, ast.expr] = dict(zip(names, call.args, strict=False))
        for keyword in call.keywords:
            if keyword.arg is None or keyword.arg not in names or keyword.arg in values:
                break
            values[keyword.arg] = keyword.value
        else:
            given = [name for name in names if name in values]
            if given != names[: len(given)] or len(given) < required:
                continue  # a gap: the values would land on the wrong parameters
            complete = len(given) == len(names)
            if not complete and re.search(r"[^\W_]", dropped):
                return None  # "with a shift of 3", "rounding up": a defaulted input in words
            if not all(is_literal_node(value) for value in values.values()):
                continue
            return f"{entry_point}({', '.join(ast.unparse(values[n]) for n in given)})", complete
    return None


def _read_value(text: str) -> tuple[str, str] | None:
    """The literal ``text`` starts with, as source, when its clause ends there and its
    sentence does not take it back (a number or word such as True or None, a string, or a
    bracketed value read to its closing bracket), and the rest of that sentence."""
    text = text.lstrip("`> \t")
    head, equals, rest = text.partition(" = ")
    if equals and arithmetic(head):  # "1 + 9 = 10": the worked sum's result
        return _read_value(rest)
    if not text:
        return None
    end: int | None
    if text[0] in "([{":
        end = closing(text, 0)
    elif text[0] in "'\"":
        end = string_end(text)
    else:
        scalar = _SCALAR.match(text)
        end = scalar.end() if scalar else None
    if end is None or not _CLAUSE_END.match(text, end) or _MORE.match(text, end):
        return None
    sentence = re.split(r"(?<=[.!?])\s", text[end:], maxsplit=1)[0]
    if sentence.rstrip().endswith("?") or _NOT_SO.search(sentence):
        return None
    source = _WORDS.get(text[:end].lower(), text[:end])
    return (source, sentence) if is_literal(source) else None


def _conditional(after: str, names: list[str], complete: bool) -> bool:
    """Whether the words after a value make it depend on more than the call: a parameter
    named ("15 when k = 3"), or, where a defaulted parameter was left out, any words at all
    ("[2, 3, 1] for a shift of 2", "3, rounding up")."""
    if not complete:  # only a joining word may follow: "f(2) returns 4, and f(2, 3) ..."
        return not re.fullmatch(r"[\s,.;:]*(?:(?:and|while|whereas|then)\b[\s,.;:]*)?", after)
    return _names_any(after, names)


def _last_sentence(text: str) -> str:
    return re.split(r"[.!?](?:\s|$)", text)[-1]


def _names_any(text: str, names: list[str]) -> bool:
    return any(re.search(rf"\b{re.escape(name)}\b", text) for name in names)


def _lines(prompt: str) -> list[str]:
    return [line for line in prompt.splitlines() if len(line) <= MAX_LINE_CHARS]
