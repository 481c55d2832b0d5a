"""The agent's vector memory against a real embedded Qdrant in a temporary folder, no mocks."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sandlot.agent.config import AgentSettings
from sandlot.agent.embedders import Embedder, HashingEmbedder, LlamaEmbedder
from sandlot.agent.memory import (
    COLLECTION_NAME,
    DEFAULT_MAX_RECORDS,
    DEFAULT_MAX_RECORDS_PER_TENANT,
    DEFAULT_RETENTION_S,
    SOLVED_BONUS,
    AgentMemory,
)
from sandlot.agent.recall import (
    RECALL_CODE_MAX_CHARS,
    RECALL_MAX_CHARS,
    RECALL_TEXT_MAX_CHARS,
    STORED_ERRORS,
    MemoryRecord,
    format_recall,
)
from sandlot.config import get_settings
from sandlot.errors import BackendUnavailable, ConfigError

CSV_TASK = "Write a function parse_csv(path) that reads a CSV file and returns its rows as dicts"
FIB_TASK = "Implement fibonacci(n) that returns the n-th Fibonacci number"
PALINDROME_TASK = "Write is_palindrome(text) that tells whether a string reads the same backwards"
MERGE_TASK = "Merge two sorted lists into one sorted list"

CSV_CODE = (
    "import csv\n\ndef parse_csv(path):\n"
    "    with open(path) as f:\n        return list(csv.DictReader(f))\n"
)


def settings_at(folder: Path, **bounds: object) -> AgentSettings:
    # qdrant_url=None explicitly: a developer's QDRANT_URL must not send tests to a server.
    return AgentSettings.model_validate({"qdrant_path": folder, "qdrant_url": None, **bounds})


def solved(task: str, code: str = "pass", **fields: object) -> MemoryRecord:
    return MemoryRecord.model_validate({"task": task, "code": code, "outcome": "solved", **fields})


def dot(left: list[float], right: list[float]) -> float:
    return sum(a * b for a, b in zip(left, right, strict=True))


@pytest.fixture
async def memory(tmp_path: Path) -> AsyncIterator[AgentMemory]:
    opened = await AgentMemory.open(settings_at(tmp_path / "memory"))
    yield opened
    await opened.close()


# --- HashingEmbedder ---------------------------------------------------------------------


def test_hashing_embedder_is_a_normalised_embedder() -> None:
    embedder = HashingEmbedder()
    assert isinstance(embedder, Embedder)
    texts = [CSV_TASK, "", "the a of", "!!!", "parseCSVFile snake_case_name"]
    vectors = embedder.embed(texts)
    assert len(vectors) == len(texts)
    for vector in vectors:
        assert len(vector) == embedder.dimensions == 512
        assert math.isclose(math.sqrt(dot(vector, vector)), 1.0, rel_tol=1e-9)


def test_hashing_embedder_splits_identifiers_and_skips_stop_words() -> None:
    embedder = HashingEmbedder()
    [identifier, words, other] = embedder.embed(
        ["parseCsvFile", "parse csv file", "compute the factorial"]
    )
    assert dot(identifier, words) > 0.5
    assert dot(identifier, words) > dot(identifier, other) + 0.3
    # What every task says ("write a function that returns") must not make tasks alike.
    [total, reverse] = embedder.embed(
        [
            "Write a function that returns the sum of a list",
            "Write a function that returns the string reversed",
        ]
    )
    assert dot(total, reverse) < 0.2


def test_hashing_embedder_is_stable_across_processes() -> None:
    texts = [CSV_TASK, FIB_TASK, "camelCaseName and snake_case_name"]
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys\n"
            "from sandlot.agent.embedders import HashingEmbedder\n"
            "print(json.dumps(HashingEmbedder().embed(json.loads(sys.argv[1]))))",
            json.dumps(texts),
        ],
        # Another hash seed than ours: a vector built on the salted hash() would differ.
        env={**os.environ, "PYTHONHASHSEED": str(os.getpid() % 4000 + 1)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(child.stdout) == HashingEmbedder().embed(texts)


def test_hashing_embedder_refuses_tiny_dimensions() -> None:
    with pytest.raises(ConfigError, match="dimensions"):
        HashingEmbedder(dimensions=4)


# --- AgentMemory -------------------------------------------------------------------------


async def test_recall_finds_the_similar_task_first(memory: AgentMemory) -> None:
    await memory.remember(solved(CSV_TASK, CSV_CODE, attempts=2, errors=["KeyError: 'name'"]))
    await memory.remember(solved(FIB_TASK, "def fibonacci(n): ..."))
    await memory.remember(solved(PALINDROME_TASK, "def is_palindrome(t): ..."))
    await memory.remember(solved(MERGE_TASK, "def merge(a, b): ..."))
    assert await memory.count() == 4

    hits = await memory.recall("Load a csv file into a list of dictionaries", min_score=-1.0)
    assert len(hits) == 3
    best, best_score = hits[0]
    assert best.task == CSV_TASK
    assert best.code == CSV_CODE
    assert best.errors == ["KeyError: 'name'"]
    assert best.attempts == 2
    assert best.created_at.tzinfo is not None
    assert all(best_score > score + 0.15 for _, score in hits[1:])

    # With the default threshold the unrelated tasks are not recalled at all.
    default_hits = await memory.recall("Load a csv file into a list of dictionaries")
    assert [record.task for record, _ in default_hits] == [CSV_TASK]
    assert await memory.recall("draw a red circle on a canvas") == []


async def test_recall_is_the_tenants_own(memory: AgentMemory) -> None:
    # Failed before (red team, 2026-11-25): one collection for all of a server's tenants, and
    # tenant B's prompt carried tenant A's task and code, a secret in it included.
    await memory.remember(solved(CSV_TASK, "SECRET_OF_A = 1", tenant="a"))
    await memory.remember(solved(CSV_TASK, "local code"))
    # A point an older version wrote has no tenant field: it is nobody's but the local runs'.
    old = solved(CSV_TASK, "old code").model_dump(mode="json")
    del old["tenant"]
    vector = HashingEmbedder().embed([CSV_TASK])[0]
    from qdrant_client import models

    memory._client.upsert(
        COLLECTION_NAME, points=[models.PointStruct(id=1, vector=vector, payload=old)], wait=True
    )

    def codes(hits: list[tuple[MemoryRecord, float]]) -> list[str]:
        return sorted(record.code for record, _ in hits)

    assert codes(await memory.recall(CSV_TASK, tenant="a")) == ["SECRET_OF_A = 1"]
    assert await memory.recall(CSV_TASK, tenant="b") == []
    assert codes(await memory.recall(CSV_TASK)) == ["local code", "old code"]


async def test_recall_prefers_solved_and_skips_failures_without_a_fix(
    memory: AgentMemory,
) -> None:
    task = (
        "Compute the median of a list of numbers; for an even length average the two middle "
        "values, and ignore None entries"
    )
    await memory.remember(
        MemoryRecord(task=task, code="bad", outcome="failed", errors=["IndexError"], attempts=3)
    )
    await memory.remember(
        MemoryRecord(
            task=task,
            code="almost",
            outcome="failed",
            errors=["wrong for even lengths"],
            fix="average the two middle values",
        )
    )
    # Slightly less similar than the failures, but within SOLVED_BONUS of them.
    await memory.remember(solved(task + " too", "def median(xs): ..."))

    hits = await memory.recall(task, limit=5)
    assert [record.code for record, _ in hits] == ["def median(xs): ...", "almost"]
    assert hits[1][0].fix == "average the two middle values"
    (_, solved_score), (_, failed_score) = hits
    assert failed_score - SOLVED_BONUS < solved_score < failed_score


async def test_forget_all_empties_the_collection(memory: AgentMemory) -> None:
    await memory.remember(solved(FIB_TASK))
    assert await memory.count() == 1
    await memory.forget_all()
    assert await memory.count() == 0
    assert await memory.recall(FIB_TASK) == []
    await memory.remember(solved(FIB_TASK))
    assert await memory.count() == 1


async def test_recall_threshold_defaults_to_the_embedders(tmp_path: Path) -> None:
    strict = HashingEmbedder()
    strict.min_score = 0.99
    async with await AgentMemory.open(settings_at(tmp_path / "memory"), strict) as memory:
        await memory.remember(solved(FIB_TASK))
        assert await memory.recall("the nth fibonacci number") == []
        assert len(await memory.recall("the nth fibonacci number", min_score=0.3)) == 1


async def test_recall_refuses_a_zero_limit(memory: AgentMemory) -> None:
    with pytest.raises(ConfigError, match="limit"):
        await memory.recall(FIB_TASK, limit=0)


async def test_memory_persists_across_close_and_reopen(tmp_path: Path) -> None:
    settings = settings_at(tmp_path / "memory")
    async with await AgentMemory.open(settings) as first:
        point_id = await first.remember(solved(FIB_TASK, "def fibonacci(n): ..."))
    assert len(point_id) == 36  # a UUID
    with pytest.raises(ConfigError, match="closed"):
        await first.count()

    async with await AgentMemory.open(settings) as second:
        assert await second.count() == 1
        [(record, _)] = await second.recall("the nth fibonacci number")
        assert record.code == "def fibonacci(n): ..."


async def test_embedded_folder_admits_one_client_at_a_time(tmp_path: Path) -> None:
    settings = settings_at(tmp_path / "memory")
    first = await AgentMemory.open(settings)
    with pytest.raises(BackendUnavailable, match="QDRANT_PATH"):
        await AgentMemory.open(settings)
    await first.close()
    await first.close()  # idempotent
    second = await AgentMemory.open(settings)  # close() released the lock
    await second.close()


async def test_vector_size_mismatch_is_refused(tmp_path: Path) -> None:
    settings = settings_at(tmp_path / "memory")
    async with await AgentMemory.open(settings, HashingEmbedder(dimensions=512)) as memory:
        await memory.remember(solved(FIB_TASK))
    with pytest.raises(ConfigError, match=r"512-dim cosine.*64-dim.*QDRANT_PATH"):
        await AgentMemory.open(settings, HashingEmbedder(dimensions=64))
    # The refused open released the folder, and the store is intact.
    async with await AgentMemory.open(settings) as memory:
        assert await memory.count() == 1


async def test_default_folder_is_under_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        async with await AgentMemory.open(AgentSettings(qdrant_url=None, qdrant_path=None)) as m:
            assert m.location == str(tmp_path / "memory")
            await m.remember(solved(FIB_TASK))
        assert (tmp_path / "memory" / "collection" / COLLECTION_NAME).is_dir()
    finally:
        get_settings.cache_clear()


# --- bounds of what is kept ------------------------------------------------------------
# Failed before (red team, 2026-12-07): every task of every tenant was kept for good, whole;
# 1,500 tasks of 20,000 characters grew the server's RSS by 159 MiB.


def minutes_ago(minutes: float) -> datetime:
    return datetime.now(UTC) - timedelta(minutes=minutes)


async def codes_of(memory: AgentMemory, tenant: str | None) -> set[str]:
    hits = await memory.recall(CSV_TASK, limit=50, min_score=-1.0, tenant=tenant)
    return {record.code for record, _ in hits}


async def test_a_tenant_keeps_its_newest_records_up_to_the_cap(tmp_path: Path) -> None:
    cap = 5
    settings = settings_at(tmp_path / "memory", memory_max_records_per_tenant=cap)
    async with await AgentMemory.open(settings) as memory:
        await memory.remember(solved(CSV_TASK, "b0", tenant="b", created_at=minutes_ago(99)))
        await memory.remember(solved(CSV_TASK, "local", created_at=minutes_ago(98)))
        # Stored out of order: eviction goes by created_at, the oldest first.
        for number in [3, 0, 7, 1, 5, 2, 6, 4]:
            record = solved(CSV_TASK, f"a{number}", tenant="a", created_at=minutes_ago(50 - number))
            await memory.remember(record)
        assert await memory.count() == cap + 2
        assert await codes_of(memory, "a") == {"a3", "a4", "a5", "a6", "a7"}
        # Another tenant's records, and the tenantless ones, are untouched.
        assert await codes_of(memory, "b") == {"b0"}
        assert await codes_of(memory, None) == {"local"}


async def test_expired_records_are_not_recalled_and_deleted(tmp_path: Path) -> None:
    settings = settings_at(tmp_path / "memory", memory_retention_s=3600)
    async with await AgentMemory.open(settings) as memory:
        # Written as a store that kept them longer would have: straight into Qdrant.
        from qdrant_client import models

        vector = HashingEmbedder().embed([CSV_TASK])[0]
        old = [
            solved(CSV_TASK, code, tenant=tenant, created_at=minutes_ago(61))
            for code, tenant in [("old a", "a"), ("old b", "b")]
        ]
        memory._client.upsert(
            COLLECTION_NAME,
            points=[
                models.PointStruct(id=n, vector=vector, payload=r.model_dump(mode="json"))
                for n, r in enumerate(old, start=1)
            ],
            wait=True,
        )
        await memory.remember(solved(CSV_TASK, "new b", tenant="b", created_at=minutes_ago(59)))
        assert await codes_of(memory, "a") == set()
        assert await codes_of(memory, "b") == {"new b"}
        # b's store deleted b's expired record; a's waits for a store of a's, or a reopen.
        assert await memory.count() == 2
    async with await AgentMemory.open(settings) as memory:
        assert await memory.count() == 1


async def test_all_tenants_together_are_capped(tmp_path: Path) -> None:
    settings = settings_at(tmp_path / "memory", memory_max_records=10)
    async with await AgentMemory.open(settings) as memory:
        for number in range(10):
            tenant = f"t{number % 3}"
            record = solved(CSV_TASK, f"{tenant}-{number}", tenant=tenant)
            await memory.remember(
                record.model_copy(update={"created_at": minutes_ago(50 - number)})
            )
        assert await memory.count() == 10
        await memory.remember(solved(CSV_TASK, "t0-10", tenant="t0"))
        # Past the cap, trimmed to 90% of it: the two oldest of all went.
        assert await memory.count() == 9
        assert await codes_of(memory, "t0") == {"t0-3", "t0-6", "t0-9", "t0-10"}
        assert await codes_of(memory, "t1") == {"t1-4", "t1-7"}
        assert await codes_of(memory, "t2") == {"t2-2", "t2-5", "t2-8"}


async def test_an_oversized_record_is_stored_cut_to_what_recall_shows(
    memory: AgentMemory,
) -> None:
    task = CSV_TASK + " " + "and more words " * 1500
    assert len(task) > 20_000
    record = MemoryRecord(
        task=task,
        code="x = 1\n" * 4000,
        outcome="failed",
        errors=[f"error {n}: " + "e" * 5000 for n in range(10)],
        fix="f" * 5000,
        tenant="a",
    )
    await memory.remember(record)
    [(stored, score)] = await memory.recall(task, tenant="a")
    assert score > 0.99  # the task was embedded whole
    assert len(stored.task) <= RECALL_TEXT_MAX_CHARS
    assert stored.task.startswith(CSV_TASK)
    assert len(stored.code) <= RECALL_CODE_MAX_CHARS
    assert stored.code.startswith("x = 1\n")
    assert [error[:8] for error in stored.errors] == ["error 7:", "error 8:", "error 9:"]
    assert len(stored.errors) == STORED_ERRORS
    assert all(len(error) <= RECALL_TEXT_MAX_CHARS for error in stored.errors)
    assert stored.fix is not None and len(stored.fix) <= RECALL_TEXT_MAX_CHARS
    # What the prompt shows of it is what it showed of the record whole.
    assert format_recall([(stored, score)]) == format_recall([(record, score)])
    # A record that fits is stored as it is.
    await memory.remember(solved(FIB_TASK, " def f(): ...\n", errors=["E"], fix=" fix "))
    [(small, _)] = await memory.recall(FIB_TASK)
    assert (small.code, small.errors, small.fix) == (" def f(): ...\n", ["E"], " fix ")


def test_memory_bounds_are_settings() -> None:
    settings = AgentSettings.model_validate(
        {
            "AGENT_MEMORY_MAX_RECORDS_PER_TENANT": "7",
            "AGENT_MEMORY_MAX_RECORDS": "70",
            "AGENT_MEMORY_RETENTION_SECONDS": "60",
        }
    )
    assert settings.memory_max_records_per_tenant == 7
    assert settings.memory_max_records == 70
    assert settings.memory_retention_s == 60
    # AgentMemory's own defaults, for one built without settings, are the settings'.
    defaults = AgentSettings()
    assert defaults.memory_max_records_per_tenant == DEFAULT_MAX_RECORDS_PER_TENANT == 500
    assert defaults.memory_max_records == DEFAULT_MAX_RECORDS == 5_000
    assert defaults.memory_retention_s == DEFAULT_RETENTION_S == 30 * 24 * 3600


async def test_the_first_tasks_at_once_share_one_memory(tmp_path: Path) -> None:
    # Failed before (red team, 2026-12-07): the first tasks opened the memory each on its
    # own, and all but one found the embedded folder locked (a 503 on POST /execute).
    from sandlot.agent.providers.scripted import ScriptedProvider
    from sandlot.agent.runtime import AgentRuntime

    settings = settings_at(tmp_path / "memory", memory_enabled=True)
    runtime = AgentRuntime(ScriptedProvider([]), settings=settings)
    try:
        opened = await asyncio.gather(*(runtime.memory() for _ in range(4)))
        assert opened[0] is not None
        assert all(memory is opened[0] for memory in opened)
    finally:
        await runtime.aclose()
    # aclose() closed the one memory opened: the folder is free again.
    async with await AgentMemory.open(settings_at(tmp_path / "memory")):
        pass


@pytest.fixture
def closed_port() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    yield port


async def test_unreachable_server_is_reported(closed_port: int) -> None:
    settings = AgentSettings(qdrant_url=f"http://127.0.0.1:{closed_port}")
    with pytest.raises(BackendUnavailable, match="QDRANT_URL"):
        await AgentMemory.open(settings)


async def test_missing_qdrant_client_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "qdrant_client", None)
    with pytest.raises(ConfigError, match=r"sandlot\[memory\]"):
        await AgentMemory.open(settings_at(tmp_path / "memory"))


# --- format_recall -----------------------------------------------------------------------


def test_format_recall_is_compact_and_bounded() -> None:
    assert format_recall([]) == ""
    fixed = MemoryRecord(
        task=MERGE_TASK,
        code="def merge(a, b):\n    return sorted(a + b)\n",
        outcome="solved",
        errors=["AssertionError: merge([1], []) returned None"],
        fix="return the merged list instead of printing it",
        attempts=2,
    )
    text = format_recall([(fixed, 0.81)])
    assert text.startswith("Similar past tasks")
    assert MERGE_TASK in text
    assert "failed with: AssertionError" in text
    assert "fixed by: return the merged list" in text
    assert "worked:\ndef merge(a, b):" in text
    assert "0.81" in text

    huge = MemoryRecord(
        task="x" * 5_000, code="y = 1\n" * 5_000, outcome="solved", errors=["z" * 5_000]
    )
    bounded = format_recall([(huge, 0.9)] * 10)
    assert 0 < len(bounded) <= RECALL_MAX_CHARS
    assert "..." in bounded
    small = format_recall([(huge, 0.9)] * 10, max_chars=400)
    assert "1. xxx" in small
    assert "2. " not in small
    assert len(small) <= 400
    assert format_recall([(huge, 0.9)], max_chars=100) == ""


# --- LlamaEmbedder (optional) ------------------------------------------------------------


def llama_embedder_or_skip() -> LlamaEmbedder:
    pytest.importorskip("llama_cpp")
    # conftest clears SANDLOT_* before any test runs (so a developer's settings never
    # leak in); TEST_GGUF, like TEST_BACKENDS, survives that.
    gguf = os.environ.get("TEST_GGUF") or os.environ.get("SANDLOT_TEST_GGUF")
    if not gguf or not Path(gguf).is_file():
        pytest.skip("set TEST_GGUF to a GGUF file to test LlamaEmbedder")
    return LlamaEmbedder(gguf)


def test_llama_embedder_embeds_similar_texts_closer() -> None:
    embedder = llama_embedder_or_skip()
    try:
        assert isinstance(embedder, Embedder)
        [csv_a, csv_b, fib] = embedder.embed([CSV_TASK, "read rows of a csv file", FIB_TASK])
        assert len(csv_a) == embedder.dimensions > 0
        assert math.isclose(math.sqrt(dot(csv_a, csv_a)), 1.0, rel_tol=1e-6)
        assert dot(csv_a, csv_b) > dot(csv_b, fib)
    finally:
        embedder.close()


async def test_agent_memory_recalls_with_a_llama_embedder(tmp_path: Path) -> None:
    embedder = llama_embedder_or_skip()
    try:
        settings = settings_at(tmp_path / "memory")
        async with await AgentMemory.open(settings, embedder) as memory:
            await memory.remember(solved(CSV_TASK, CSV_CODE))
            await memory.remember(solved(FIB_TASK))
            hits = await memory.recall("read rows of a csv file", min_score=-1.0)
        assert [record.task for record, _ in hits] == [CSV_TASK, FIB_TASK]
    finally:
        embedder.close()


def test_llama_embedder_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no GGUF file"):
        LlamaEmbedder(tmp_path / "absent.gguf")
