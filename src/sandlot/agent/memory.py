"""Vector memory of the agent layer: past tasks, the errors met on the way, the fixes that worked.

Each finished task becomes a :class:`~sandlot.agent.recall.MemoryRecord`. Its task text is
embedded and stored in Qdrant with the record as payload; before writing code for a new task
the agent recalls the most similar records, and :func:`~sandlot.agent.recall.format_recall`
turns them into a short prompt section (both in :mod:`sandlot.agent.recall`).

Where the vectors live (:meth:`AgentMemory.open`):

* ``QDRANT_URL`` set: a Qdrant server, which any number of processes may share.
* otherwise embedded Qdrant in ``QDRANT_PATH`` (default ``<data dir>/memory``). Embedded mode
  takes an exclusive file lock on its folder, so **one open client per folder**, both across
  processes and within one: open one :class:`AgentMemory` per process, share it, and
  ``close()`` it (or use ``async with``) to release the lock. Opening a locked folder raises
  :class:`~sandlot.errors.BackendUnavailable`.

Embedders:

* :class:`~sandlot.agent.embedders.HashingEmbedder`, the default, needs no dependency and no
  download. It measures *lexical* similarity (shared words, identifier parts, character
  3-grams), not meaning: "sum a list of ints" and "add up the numbers" share almost nothing
  and score low. It is good at the common case of a task asked again in other words around
  the same nouns.
* :class:`~sandlot.agent.embedders.LlamaEmbedder` embeds with a GGUF model through
  llama-cpp-python (semantic, slower).

What is kept is bounded (a red team's 1,500 records of 20,000 characters grew a server's RSS
by 159 MiB, 2026-12-07): a record is stored cut to what :func:`format_recall` shows (its task
embedded whole), each tenant keeps its newest ``AGENT_MEMORY_MAX_RECORDS_PER_TENANT``, all
tenants together ``AGENT_MEMORY_MAX_RECORDS``, and none older than
``AGENT_MEMORY_RETENTION_SECONDS`` is recalled or kept (:meth:`AgentMemory.remember`).

The vector size is fixed when the collection is created; a store written by an embedder of
another size is refused with :class:`~sandlot.errors.ConfigError`, never mixed.

The qdrant-client calls are synchronous and run in a worker thread under one lock: embedded
mode is a SQLite file that must not be written from two threads at once, and the event loop
must not stall on its disk writes. Embeddings run on a thread of the memory's own, one at a
time: a GGUF embedder's forward passes queued in the loop's default executor would hold the
threads that the sandboxes' lifecycle needs (as the local model's calls did, a red team's F3).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import structlog
from pydantic import ValidationError

from sandlot.agent.embedders import DEFAULT_MIN_SCORE, Embedder, HashingEmbedder
from sandlot.agent.recall import (
    MemoryRecord,
    bounded,
    created_at,
)
from sandlot.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:
    from qdrant_client import QdrantClient, models
    from qdrant_client.conversions.common_types import PointId

    from sandlot.agent.config import AgentSettings

log = structlog.get_logger(__name__)

COLLECTION_NAME = "agent_memory"
INSTALL_HINT = "pip install 'sandlot[memory]'"

# A solved record beats a failure that is this much more similar: working code is the better
# hint, but a much closer failure with its fix still wins.
SOLVED_BONUS = 0.05
# Qdrant is asked for more than `limit` hits so that the solved-first re-ranking has a choice.
CANDIDATES_PER_HIT = 3
# Bounds of what is kept (AGENT_MEMORY_MAX_RECORDS_PER_TENANT and the rest, in AgentSettings).
DEFAULT_MAX_RECORDS_PER_TENANT = 500
DEFAULT_MAX_RECORDS = 5_000
DEFAULT_RETENTION_S = 30 * 24 * 3600.0
# Past AGENT_MEMORY_MAX_RECORDS the store is trimmed to this share of it, so that the scan of
# every record's age runs once per tenth of the cap, not on every store.
TRIM_TO_SHARE = 0.9
# Every tenant's expired records are deleted at most this often while records are stored
# (each tenant's own at every store of theirs).
PURGE_INTERVAL_S = 3600.0
SCROLL_BATCH = 1000

T = TypeVar("T")


def _import_qdrant() -> Any:
    try:
        return importlib.import_module("qdrant_client")
    except ImportError as exc:
        raise ConfigError(f"the agent memory needs qdrant-client: {INSTALL_HINT}") from exc


class AgentMemory:
    """Past tasks in a Qdrant collection, recalled by similarity of their task text.

    Build it with :meth:`open`. Every Qdrant call runs in a worker thread under one lock, so
    concurrent tasks (even on different event loops) may share one instance, as embedded mode
    requires.
    """

    def __init__(
        self,
        client: QdrantClient,
        embedder: Embedder,
        *,
        location: str,
        max_records_per_tenant: int = DEFAULT_MAX_RECORDS_PER_TENANT,
        max_records: int = DEFAULT_MAX_RECORDS,
        retention_s: float = DEFAULT_RETENTION_S,
        sole_client: bool = False,
    ) -> None:
        """``sole_client``: no other client writes the collection (embedded mode's lock
        says so), so the memory may keep each tenant's record ages itself."""
        if max_records_per_tenant < 1 or max_records < 1 or retention_s <= 0:
            raise ConfigError(
                "the agent memory needs AGENT_MEMORY_MAX_RECORDS_PER_TENANT >= 1, "
                "AGENT_MEMORY_MAX_RECORDS >= 1 and AGENT_MEMORY_RETENTION_SECONDS > 0"
            )
        self._client = client
        self.embedder = embedder
        self.location = location
        self.max_records_per_tenant = max_records_per_tenant
        self.max_records = max_records
        self.retention_s = retention_s
        self._next_purge_at = 0.0  # time.monotonic() of the next purge of every expired record
        # Each tenant's (created_at, point id), oldest first, once read: embedded Qdrant
        # filters in Python, a scan of every record that took 55 ms at 5,000 of them.
        self._tenant_ages: dict[str | None, list[tuple[datetime, PointId]]] | None = (
            {} if sole_client else None
        )
        self._lock = threading.Lock()
        # Queued embeddings wait in this executor's queue, holding no thread; its one thread
        # starts with the first embedding.
        self._embedding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandlot-embed")
        self._closed = False

    @classmethod
    async def open(
        cls, settings: AgentSettings | None = None, embedder: Embedder | None = None
    ) -> Self:
        """Connect to the store the settings name and make sure the collection fits.

        Args:
            settings: Agent settings (default: :func:`get_agent_settings`). ``qdrant_url``
                selects a server; else embedded mode in ``qdrant_path`` or
                ``<data dir>/memory``. The ``memory_max_records*`` and
                ``memory_retention_s`` bound what is kept; expired records are deleted here.
            embedder: Default :class:`HashingEmbedder`.

        Raises:
            ConfigError: qdrant-client is not installed, or the collection holds vectors of
                another size than the embedder's.
            BackendUnavailable: the server does not answer, or another client holds the
                embedded folder's lock.
        """
        if settings is None:
            from sandlot.agent.config import get_agent_settings

            settings = get_agent_settings()
        chosen = embedder if embedder is not None else HashingEmbedder()
        return await asyncio.to_thread(cls._open_sync, settings, chosen)

    @classmethod
    def _open_sync(cls, settings: AgentSettings, embedder: Embedder) -> Self:
        qdrant_client = _import_qdrant()
        client: QdrantClient
        if settings.qdrant_url:
            location = settings.qdrant_url
            # We probe the server right below; the client's own version probe only warns.
            client = qdrant_client.QdrantClient(url=location, check_compatibility=False)
        else:
            folder = settings.qdrant_path or _default_memory_dir()
            location = str(folder)
            # qdrant-client leaks its lock file's handle when the lock is taken; probing first
            # keeps the common case clean (the except below still covers a race).
            _refuse_if_locked(folder)
            try:
                # Our lock serialises every call, so the SQLite handle may cross threads.
                client = qdrant_client.QdrantClient(
                    path=location, force_disable_check_same_thread=True
                )
            except RuntimeError as exc:
                if "already accessed" not in str(exc):
                    raise
                raise _folder_locked(folder) from exc
        memory = cls(
            client,
            embedder,
            location=location,
            max_records_per_tenant=settings.memory_max_records_per_tenant,
            max_records=settings.memory_max_records,
            retention_s=settings.memory_retention_s,
            sole_client=not settings.qdrant_url,
        )
        try:
            memory._locked(memory._ensure_collection)
            memory._locked(memory._purge_expired, memory._cutoff())
        except BaseException:
            client.close()
            raise
        return memory

    def _ensure_collection(self) -> None:
        from qdrant_client import models

        if not self._client.collection_exists(COLLECTION_NAME):
            self._client.create_collection(
                COLLECTION_NAME,
                vectors_config=models.VectorParams(
                    size=self.embedder.dimensions, distance=models.Distance.COSINE
                ),
            )
            return
        vectors = self._client.get_collection(COLLECTION_NAME).config.params.vectors
        if (
            not isinstance(vectors, models.VectorParams)
            or vectors.size != self.embedder.dimensions
            or vectors.distance != models.Distance.COSINE
        ):
            found = (
                f"{vectors.size}-dim {vectors.distance.value.lower()}"
                if isinstance(vectors, models.VectorParams)
                else "named"
            )
            raise ConfigError(
                f"collection {COLLECTION_NAME!r} at {self.location} holds {found} vectors, "
                f"this embedder makes {self.embedder.dimensions}-dim cosine ones; use the "
                "embedder that wrote it, or point QDRANT_PATH (or QDRANT_URL) at a fresh store"
            )

    async def remember(self, record: MemoryRecord) -> str:
        """Store one record; returns its point id (a UUID string).

        The task is embedded whole, but the record is stored cut to what
        :func:`format_recall` shows of it: task, last error and fix to
        ``RECALL_TEXT_MAX_CHARS``, code to ``RECALL_CODE_MAX_CHARS``, the last
        ``STORED_ERRORS`` errors. Then the record's tenant keeps its newest
        ``max_records_per_tenant`` unexpired records (the oldest are deleted, and the
        expired), and past ``max_records`` in all the oldest of all go, down to
        ``TRIM_TO_SHARE`` of it.
        """
        from qdrant_client import models

        vector = await self._embed(record.task)
        point_id = str(uuid.uuid4())
        point = models.PointStruct(
            id=point_id, vector=vector, payload=bounded(record).model_dump(mode="json")
        )
        await self._call(self._store, point, record.tenant)
        return point_id

    def _store(self, point: models.PointStruct, tenant: str | None) -> None:
        from qdrant_client import models

        # One call under the lock: two stores of one tenant at once must not both see
        # room for one more.
        self._client.upsert(COLLECTION_NAME, points=[point], wait=True)
        cutoff = self._cutoff()
        if self._tenant_ages is not None and tenant in self._tenant_ages:
            ages = [*self._tenant_ages[tenant], (created_at(point.payload), point.id)]
        else:
            ages = self._ages(models.Filter(must=[_owner(tenant)]))
        kept = self._keep_newest(ages, self.max_records_per_tenant, cutoff)
        if self._tenant_ages is not None:
            self._tenant_ages[tenant] = kept
        if self._client.count(COLLECTION_NAME, exact=True).count > self.max_records:
            self._keep_newest(
                self._ages(None), max(1, int(self.max_records * TRIM_TO_SHARE)), cutoff
            )
            self._forget_ages()
        elif time.monotonic() >= self._next_purge_at:
            self._purge_expired(cutoff)

    def _keep_newest(
        self, ages: list[tuple[datetime, PointId]], kept: int, cutoff: datetime
    ) -> list[tuple[datetime, PointId]]:
        """Delete the expired of ``ages`` and all but the ``kept`` newest of the rest;
        returns the ages of those left, oldest first."""
        ages = sorted(ages, key=lambda age: (age[0], str(age[1])))
        alive = [age for age in ages if age[0] >= cutoff]
        evicted = max(0, len(alive) - kept)
        doomed = [point_id for created_at, point_id in ages if created_at < cutoff]
        doomed += [point_id for _, point_id in alive[:evicted]]
        if doomed:
            from qdrant_client import models

            self._client.delete(
                COLLECTION_NAME, points_selector=models.PointIdsList(points=doomed), wait=True
            )
        return alive[evicted:]

    def _forget_ages(self) -> None:
        """After a delete by other means than _keep_newest: read the ages again when needed."""
        if self._tenant_ages is not None:
            self._tenant_ages.clear()

    def _ages(self, where: models.Filter | None) -> list[tuple[datetime, PointId]]:
        """When each record that ``where`` selects was created, with its point id."""
        ages: list[tuple[datetime, PointId]] = []
        offset: PointId | None = None
        while True:
            points, offset = self._client.scroll(
                COLLECTION_NAME,
                scroll_filter=where,
                limit=SCROLL_BATCH,
                offset=offset,
                with_payload=["created_at"],
                with_vectors=False,
            )
            ages += [(created_at(point.payload), point.id) for point in points]
            if offset is None:
                return ages

    def _purge_expired(self, cutoff: datetime) -> None:
        from qdrant_client import models

        self._next_purge_at = time.monotonic() + PURGE_INTERVAL_S
        self._forget_ages()
        self._client.delete(
            COLLECTION_NAME,
            points_selector=models.FilterSelector(
                filter=models.Filter(
                    should=[
                        models.FieldCondition(
                            key="created_at", range=models.DatetimeRange(lt=cutoff)
                        ),
                        models.IsEmptyCondition(is_empty=models.PayloadField(key="created_at")),
                    ]
                )
            ),
            wait=True,
        )

    def _cutoff(self) -> datetime:
        """Records created before this have expired."""
        return datetime.now(UTC) - timedelta(seconds=self.retention_s)

    async def recall(
        self,
        task: str,
        limit: int = 3,
        min_score: float | None = None,
        *,
        tenant: str | None = None,
    ) -> list[tuple[MemoryRecord, float]]:
        """The records most like ``task``, best first, with their cosine score.

        Only ``tenant``'s records are recalled (with None, only those remembered with no
        tenant): one server's memory holds every tenant's tasks and code, which another
        tenant's prompt must never carry (a red team's find, 2026-11-25). Records older
        than ``retention_s`` are not recalled.

        Solved records rank first at similar scores (``SOLVED_BONUS``); failures count only
        when they carry a fix. Records scoring below ``min_score`` are left out; by default
        the embedder's own ``min_score`` (scores mean different things per embedder), else
        ``DEFAULT_MIN_SCORE``.
        """
        if limit < 1:
            raise ConfigError(f"recall needs limit >= 1, got {limit}")
        if min_score is None:
            min_score = float(getattr(self.embedder, "min_score", DEFAULT_MIN_SCORE))
        vector = await self._embed(task)
        cutoff = self._cutoff()
        response = await self._call(
            self._client.query_points,
            COLLECTION_NAME,
            query=vector,
            query_filter=_useful_records_filter(tenant, cutoff),
            limit=limit * CANDIDATES_PER_HIT,
            score_threshold=min_score,
            with_payload=True,
        )
        hits: list[tuple[MemoryRecord, float]] = []
        for point in response.points:
            try:
                record = MemoryRecord.model_validate(point.payload)
            except ValidationError:
                # A shared server may hold points another version wrote; skip, do not fail.
                log.warning("memory_point_unreadable", point_id=str(point.id))
                continue
            # The filter's word, checked again here.
            if record.tenant == tenant and record.created_at >= cutoff:
                hits.append((record, point.score))
        hits.sort(
            key=lambda hit: hit[1] + (SOLVED_BONUS if hit[0].outcome == "solved" else 0.0),
            reverse=True,
        )
        return hits[:limit]

    async def count(self) -> int:
        """How many records are stored."""
        result = await self._call(self._client.count, COLLECTION_NAME, exact=True)
        return result.count

    async def forget_all(self) -> None:
        """Delete every record (the collection is recreated empty)."""

        def reset() -> None:
            self._forget_ages()
            self._client.delete_collection(COLLECTION_NAME)
            self._ensure_collection()

        await self._call(reset)

    async def close(self) -> None:
        """Release the client (and the embedded folder's lock). Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Embeddings already queued still run; their Qdrant call then finds the memory closed.
        self._embedding.shutdown(wait=False)
        await asyncio.to_thread(self._locked, self._client.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def _embed(self, text: str) -> list[float]:
        self._refuse_if_closed()
        [vector] = await asyncio.wrap_future(self._embedding.submit(self.embedder.embed, [text]))
        return vector

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._refuse_if_closed()
        return await asyncio.to_thread(self._locked, function, *args, **kwargs)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise ConfigError("this AgentMemory is closed; open another with AgentMemory.open()")

    def _locked(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

        with self._lock:
            try:
                return function(*args, **kwargs)
            except (ResponseHandlingException, UnexpectedResponse) as exc:
                raise BackendUnavailable(
                    f"Qdrant at {self.location} failed: {exc}; check the server or unset "
                    "QDRANT_URL to use embedded mode"
                ) from exc


def _folder_locked(folder: Path) -> BackendUnavailable:
    return BackendUnavailable(
        f"the embedded Qdrant folder {folder} is open in another client (one per folder, even "
        "within a process): close it, share one AgentMemory, set QDRANT_PATH to another "
        "folder, or QDRANT_URL to a Qdrant server"
    )


def _refuse_if_locked(folder: Path) -> None:
    import portalocker  # qdrant-client's own dependency, the same lock it takes

    lock_path = folder / ".lock"
    if not lock_path.is_file():
        return
    with lock_path.open("r+") as lock_file:
        try:
            portalocker.lock(
                lock_file, portalocker.LockFlags.EXCLUSIVE | portalocker.LockFlags.NON_BLOCKING
            )
        except portalocker.exceptions.LockException as exc:
            raise _folder_locked(folder) from exc
        # Closing the file releases the probe's lock for the client about to take it.


def _default_memory_dir() -> Path:
    from sandlot.config import get_settings

    return get_settings().data_dir / "memory"


def _owner(tenant: str | None) -> models.Condition:
    """The tenant's own records (records from before tenants, with no such field, count as
    the tenantless ones)."""
    from qdrant_client import models

    if tenant is None:
        return models.IsEmptyCondition(is_empty=models.PayloadField(key="tenant"))
    return models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant))


def _useful_records_filter(tenant: str | None, cutoff: datetime) -> models.Filter:
    from qdrant_client import models

    # The tenant's own unexpired records that are solved, or failures that at least say
    # what fixed an error.
    return models.Filter(
        must=[
            _owner(tenant),
            models.FieldCondition(key="created_at", range=models.DatetimeRange(gte=cutoff)),
        ],
        should=[
            models.FieldCondition(key="outcome", match=models.MatchValue(value="solved")),
            models.Filter(
                must_not=[models.IsNullCondition(is_null=models.PayloadField(key="fix"))]
            ),
        ],
    )
