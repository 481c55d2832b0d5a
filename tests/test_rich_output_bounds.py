"""What one call's rich outputs cost the manager to hold stays near the call's output cap
(the third red team's F3, 2026-12-06): the guest counted their JSON bytes alone, but the host
holds Python objects, ~24 times as big for "[{},{},...]" and ~20 times for a flood of tiny
display() bundles. Each bundle is now measured by its JSON nodes as well as its bytes, plus a
fixed cost for its ``Result``, and a call keeps at most ``MAX_RESULTS`` of them: in the kernel,
in the supervisor, and again on the host before any model is built (the guest shares a uid
with sandboxed code)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from sandlot import Sandbox, SandboxManager
from sandlot._portal import get_portal
from sandlot.core.execution import _results
from sandlot.guest.wire import (
    JSON_NODE_COST_BYTES,
    MAX_RESULTS,
    RESULT_COST_BYTES,
    dumps,
    json_nodes,
    loads,
    result_cost,
)
from sandlot.models import RESULT_FORMATS, Result
from sandlot.requests import SandboxSpec
from tests.conftest import placement

MIB = 1 << 20


def _nodes(value: object) -> int:
    """Containers, dict keys and scalars in ``value``: the test's own count, not the one
    under test."""
    count, pending = 0, [value]
    while pending:
        item = pending.pop()
        count += 1
        if isinstance(item, dict):
            count += len(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


def _data(result: Result) -> dict[str, Any]:
    """A result's ``{mime: value}`` bundle data, as the guest sent it."""
    data = {mime: result[name] for mime, name in RESULT_FORMATS.items()}
    return {mime: value for mime, value in data.items() if value is not None} | result.extra


def _held_bytes(bundles: list[dict[str, Any]]) -> int:
    """What the manager holds for these display bundles: Results built as the host builds
    them (parsed JSON, then ``Result.from_bundle``), measured with tracemalloc here."""
    frames = [dumps(bundle) for bundle in bundles]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = [Result.from_bundle(loads(frame)["data"]) for frame in frames]
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(held) == len(bundles)
    return after - before


# --------------------------------------------------------------------- the measure, unit


def test_a_bundle_is_measured_by_its_nodes_as_well_as_its_bytes() -> None:
    """Failed before (no such measure: the guest counted JSON bytes only)."""
    # A dict, its key, its list; the list's 1 and {}: 5 nodes.
    assert json_nodes({"a": [1, {}]}, 100) == 5
    tiny = {"data": {"text/plain": "0"}, "is_main_result": False}
    wire_bytes = len('{"data":{"text/plain":"0"},"is_main_result":false}')
    assert result_cost(tiny, MIB) == RESULT_COST_BYTES + 7 * JSON_NODE_COST_BYTES + wire_bytes
    # The red team's output: 1 MiB of JSON, ~24 MiB of the host's memory.
    dicts = {"data": {"application/json": [{} for _ in range(349_458)]}, "is_main_result": False}
    assert result_cost(dicts, 8 * MIB) > 349_458 * JSON_NODE_COST_BYTES


def test_counting_nodes_stops_once_past_the_bound_and_never_recurses() -> None:
    """A list of millions is refused at the cost of its length; a value nested 100,000 deep
    is walked without recursion."""
    assert json_nodes([0] * 5_000_000, 1000) > 1000
    deep: object = 0
    for _ in range(100_000):
        deep = [deep]
    assert json_nodes(deep, 1 << 30) == 100_001


@pytest.mark.parametrize(
    "value",
    [
        [{} for _ in range(20_000)],
        [[] for _ in range(20_000)],
        [i + 0.5 for i in range(20_000)],
        [f"s{i}" for i in range(20_000)],
        {f"k{i}": i for i in range(20_000)},
        [{"a": i} for i in range(20_000)],
        ["\u00e9" + str(i) for i in range(20_000)],
        [chr(0x1F600 + i % 50) for i in range(20_000)],
    ],
    ids=["dicts", "lists", "floats", "strings", "keys", "small-dicts", "latin-1", "astral"],
)
def test_what_the_host_holds_for_a_bundle_is_within_its_cost(value: object) -> None:
    """The figures track the host's memory: the Result built from a JSON value of each shape
    that is cheap to send takes no more than the bundle was charged."""
    bundle = {"data": {"application/json": value}, "is_main_result": False}
    cost = result_cost(bundle, 1 << 40)
    assert _held_bytes([bundle]) <= cost


def test_a_result_model_is_within_the_cost_of_a_tiny_bundle() -> None:
    """A Result's own fields (~830 bytes, ~950 with an ``extra`` format) are paid for by the
    bundle's fixed cost and its nodes, however little data it carries."""
    tiny = [{"data": {"text/plain": str(i % 10)}, "is_main_result": False} for i in range(5000)]
    extra = [{"data": {"x/y": i % 10}, "is_main_result": False} for i in range(5000)]
    for bundles in (tiny, extra):
        assert _held_bytes(bundles) <= sum(result_cost(b, 1 << 40) for b in bundles)


# ------------------------------------------------------------------ the host's own check


def test_the_host_keeps_a_forged_reply_to_the_same_rule() -> None:
    """Failed before: the host built a Result for every bundle a reply listed. A reply the
    guest never sent (its channel forged, or a guest gone wrong) is held to the guest's rule
    before any model is built."""
    tiny = {"data": {"text/plain": "0"}, "is_main_result": False}
    flood = _results({"results": [tiny] * 20_000}, 8 * MIB)
    assert (len(flood["results"]), flood["results_truncated"]) == (MAX_RESULTS, True)
    dicts = {"data": {"application/json": [{}] * 349_458}, "is_main_result": False}
    big = _results({"results": [dicts, tiny]}, MIB)
    assert ([r.text for r in big["results"]], big["results_truncated"]) == (["0"], True)
    # What an honest guest kept, the host keeps whole.
    honest = _results({"results": [tiny] * 500}, MIB)
    assert len(honest["results"]) == 500 and "results_truncated" not in honest


# --------------------------------------------------------------------- in a real sandbox

JSON_DICTS = """
class J:
    def __init__(s, n): s.n = n
    def _repr_json_(s): return [{} for _ in range(s.n)]
    def __repr__(s): return 'J()'
display(J((%d - 200) // 3))
"""

# Cell code can send bundles past the kernel's own checks, through the kernel's sender.
FORGED_BUNDLES = """
send = display.__self__._send
for _ in range(400):
    send({'data': {'application/json': [{}] * 2000}, 'is_main_result': False})
'end'
"""


@pytest.mark.hostile
def test_a_cells_rich_outputs_cost_the_host_near_its_output_cap(jail: Sandbox) -> None:
    """Failed before (the red team's F3): one application/json output of "[{},{},...]" just
    under the 1 MiB cap came back whole, 349,458 dicts (+26 MiB of the manager's memory), and
    20,000 display(0) calls came back as 20,000 Results (+21 MiB). Now the big output keeps
    its text only, the flood stops at what the cap pays for, and results_truncated says so."""
    limit = jail.info.limits.output_limit_bytes
    node_bound = limit // JSON_NODE_COST_BYTES

    big = jail.run_code(JSON_DICTS % limit)
    assert big.exit_code == 0, big
    [shown] = big.results
    assert (shown.json_data, shown.text, big.results_truncated) == (None, "J()", True)
    assert "over the cell's remaining" in big.stderr

    flood = jail.run_code("for _ in range(20_000): display(0)\n'end'")
    assert flood.exit_code == 0 and flood.text == "'end'", flood
    assert flood.results_truncated
    assert 0 < len(flood.results) <= min(MAX_RESULTS, limit // RESULT_COST_BYTES)
    assert [r.text for r in flood.results[:3]] == ["0", "0", "0"]  # the first ones kept

    forged = jail.run_code(FORGED_BUNDLES)
    assert forged.exit_code == 0 and forged.results_truncated, forged
    for result in (big, flood, forged):
        bundles = [{"data": _data(r), "is_main_result": r.is_main_result} for r in result.results]
        assert sum(_nodes(bundle) for bundle in bundles) <= node_bound
        assert _held_bytes(bundles) <= limit, len(bundles)
    # The sandbox is fine afterwards.
    assert jail.run_code("1 + 1").text == "2"


@pytest.fixture
def wide(manager: SandboxManager, isolated_backend: str) -> Iterator[Sandbox]:
    """A sandbox with the largest output cap (8 MiB): the count caps it, not the cost."""
    spec = SandboxSpec.model_validate(
        {**placement(isolated_backend), "output_limit_bytes": 8 * MIB}
    )
    sb = Sandbox.connect(get_portal().call(manager.create(spec)).id, manager=manager)
    yield sb
    sb.kill()


@pytest.mark.hostile
def test_a_cell_keeps_at_most_max_results_outputs(wide: Sandbox) -> None:
    """Failed before: every display() of a cell came back while their bytes fit, 167,772
    tiny ones at the 8 MiB cap (+156 MiB of the manager's RSS). The first MAX_RESULTS are
    kept, in order, and the cell says the rest were left out."""
    result = wide.run_code("for i in range(5000): display(i)")
    assert result.exit_code == 0, result
    assert [r.text for r in result.results] == [str(i) for i in range(MAX_RESULTS)]
    assert result.results_truncated
    assert f"at most {MAX_RESULTS} outputs" in result.stderr
    within: dict[str, Any] = wide.run_code(
        f"for i in range({MAX_RESULTS}): display(i)"
    ).model_dump()
    assert (len(within["results"]), within["results_truncated"]) == (MAX_RESULTS, False)


def test_a_wide_string_costs_what_the_host_holds_for_it() -> None:
    """Failed before (the fourth red team's find, 2026-12-06): CPython keeps a string at the
    width of its widest character, so 1 MB of ASCII with one emoji holds 4 MB, but its
    escaped JSON, all the cost counted, is ~1 MB."""
    import sys

    from sandlot.guest.wire import result_cost

    wide = "a" * 1_000_000 + "\U0001f600"
    assert result_cost({"data": {"text/plain": wide}}, 1 << 30) >= sys.getsizeof(wide)
    latin = "é" * 1000  # one byte a character in memory: costed as its escapes, no more
    assert result_cost({"data": {"text/plain": latin}}, 1 << 30) < 7_000 + 1_000
