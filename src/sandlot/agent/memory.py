"""Vector memory of the agent layer: past tasks, the errors met on the way, the fixes that worked.

Each finished task becomes a :class:`MemoryRecord`. Its task text is embedded and stored in
Qdrant with the record as payload; before writing code for a new task the agent recalls the
most similar records, and :func:`format_recall` turns them into a short prompt section.

Where the vectors live (:meth:`AgentMemory.open`):

* ``QDRANT_URL`` set: a Qdrant server, which any number of processes may share.
* otherwise embedded Qdrant in ``QDRANT_PATH`` (default ``<data dir>/memory``). Embedded mode
  takes an exclusive file lock on its folder, so **one open client per folder**, both across
  processes and within one: open one :class:`AgentMemory` per process, share it, and
  ``close()`` it (or use ``async with``) to release the lock. Opening a locked folder raises
  :class:`~sandlot.errors.BackendUnavailable`.

Embedders:

* :class:`HashingEmbedder`, the default, needs no dependency and no download. It measures
  *lexical* similarity (shared words, identifier parts, character 3-grams), not meaning:
  "sum a list of ints" and "add up the numbers" share almost nothing and score low. It is good
  at the common case of a task asked again in other words around the same nouns.
* :class:`LlamaEmbedder` embeds with a GGUF model through llama-cpp-python (semantic, slower).

The vector size is fixed when the collection is created; a store written by an embedder of
another size is refused with :class:`~sandlot.errors.ConfigError`, never mixed.

The qdrant-client calls are synchronous and run in a worker thread under one lock: embedded
mode is a SQLite file that must not be written from two threads at once, and the event loop
must not stall on its disk writes.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import math
import re
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, TypeVar, runtime_checkable

import structlog
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from sandlot.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:
    from qdrant_client import QdrantClient, models

    from sandlot.agent.config import AgentSettings

log = structlog.get_logger(__name__)

COLLECTION_NAME = "agent_memory"
INSTALL_HINT = "pip install 'sandlot[memory]'"

# Cosine scores below this are noise for HashingEmbedder: unrelated coding tasks share a few
# words or 3-grams and land below about 0.2; a rephrasing of the same task scores 0.35 and up.
DEFAULT_MIN_SCORE = 0.3
# A solved record beats a failure that is this much more similar: working code is the better
# hint, but a much closer failure with its fix still wins.
SOLVED_BONUS = 0.05
# Qdrant is asked for more than `limit` hits so that the solved-first re-ranking has a choice.
CANDIDATES_PER_HIT = 3
# Bounds of format_recall: the local model has a 4096-token context, most of it for the task.
RECALL_MAX_CHARS = 1500
RECALL_CODE_MAX_CHARS = 500
RECALL_TEXT_MAX_CHARS = 200
RECALL_MIN_SECTION_CHARS = 80  # less than this of a record tells the model nothing

T = TypeVar("T")


class MemoryRecord(BaseModel):
    """One finished task, as the agent remembers it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str = Field(min_length=1, description="The task as the user asked it.")
    code: str = Field(description="The final code if solved, else the last code tried.")
    outcome: Literal["solved", "failed"] = Field(description="Whether the last code passed.")
    errors: list[str] = Field(
        default_factory=list, description="Short summaries of the errors met on the way."
    )
    fix: str | None = Field(
        default=None, description="The critique that led to the working code, if one did."
    )
    attempts: int = Field(default=1, ge=1, description="Code generations the task took.")
    created_at: AwareDatetime = Field(
        default_factory=lambda: datetime.now(UTC), description="When the task finished (UTC)."
    )


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into vectors of a fixed size. Synchronous: callers use a worker thread.

    An embedder may also have a ``min_score`` attribute: the cosine score below which its
    recalls are noise (:meth:`AgentMemory.recall` uses it as the default threshold).
    """

    dimensions: int

    def embed(self, texts: list[str]) -> list[list[float]]:
        """One vector of ``dimensions`` floats per text, in order."""
        ...


def _normalised(vector: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(value * value for value in vector))
    if norm == 0.0:
        return [float(value) for value in vector]
    return [value / norm for value in vector]


# Words that every coding task has ("write a function that returns ...") carry no signal and
# would make unrelated tasks look alike.
# fmt: off
_STOPWORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "by", "can", "do", "does", "each", "for", "from",
    "given", "has", "have", "how", "i", "if", "in", "into", "is", "it", "its", "itself", "me",
    "my", "of", "on", "one", "or", "our", "should", "so", "than", "that", "the", "their",
    "them", "then", "there", "these", "this", "those", "to", "use", "using", "was", "we",
    "what", "when", "where", "which", "while", "who", "will", "with", "without", "would",
    "write", "you", "your", "function", "method", "program", "code", "python", "implement",
    "return", "returns", "take", "takes"
})
# fmt: on
_WORD = re.compile(r"\w+")
_CAMEL_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# Sub-word 3-grams help with inflections ("sorting"/"sorted") but are many per word, so each
# weighs less than a whole word.
_WORD_WEIGHT = 1.0
_TRIGRAM_WEIGHT = 0.3


class HashingEmbedder:
    """Feature hashing of words, identifier parts and character 3-grams. Lexical, not semantic.

    Features are lower-cased words (minus common stop words), the parts of snake_case and
    camelCase identifiers (``parseCsvFile`` -> parse, csv, file), and the 3-grams of each part
    with boundary marks. Each feature is hashed with BLAKE2b (stable across processes, unlike
    the salted built-in ``hash()``) to a signed bucket; the sum is L2-normalised, so the
    cosine of two vectors approximates their weighted feature overlap.
    """

    min_score: float = DEFAULT_MIN_SCORE

    def __init__(self, dimensions: int = 512) -> None:
        if dimensions < 16:
            raise ConfigError(f"HashingEmbedder needs dimensions >= 16, got {dimensions}")
        self.dimensions = dimensions

    def embed(self, texts: list[str]) -> list[list[float]]:
        return [self._embed_one(text) for text in texts]

    def _embed_one(self, text: str) -> list[float]:
        vector = [0.0] * self.dimensions
        features = _features(text)
        if not features:
            # Only stop words or punctuation: the raw text still gives a stable, non-zero
            # vector (Qdrant cannot normalise a zero vector for cosine distance).
            features = [(f"raw:{text.strip().lower()}", 1.0)]
        for feature, weight in features:
            digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
            bucket = int.from_bytes(digest[:4], "little") % self.dimensions
            sign = 1.0 if digest[4] & 1 else -1.0
            vector[bucket] += sign * weight
        return _normalised(vector)


def _features(text: str) -> list[tuple[str, float]]:
    features: list[tuple[str, float]] = []
    for token in _WORD.findall(text):
        lowered = token.lower()
        parts = [
            part.lower()
            for chunk in token.split("_")
            for part in _CAMEL_PART.findall(chunk) or [chunk]
            if chunk
        ]
        # Parts share the word namespace, so "parse_csv" and "parse a CSV" match.
        words = {lowered, *parts} if len(parts) > 1 else {lowered}
        for word in sorted(words):
            if word in _STOPWORDS:
                continue
            features.append((f"w:{word}", _WORD_WEIGHT))
            marked = f"<{word}>"
            features.extend(
                (f"g:{marked[i : i + 3]}", _TRIGRAM_WEIGHT) for i in range(len(marked) - 2)
            )
    return features


class LlamaEmbedder:
    """Embeddings of a GGUF model through llama-cpp-python: mean-pooled, L2-normalised.

    Semantic where :class:`HashingEmbedder` is lexical, at the cost of a model load and a
    forward pass per text. A text longer than ``context_tokens`` is truncated.

    ``min_score`` is the recall threshold to use with it. Mean-pooled embeddings of a
    generative model sit close together: with qwen2.5-coder-1.5b unrelated coding tasks scored
    0.58-0.69 and a rephrasing 0.79, hence 0.75; tune it for another model.
    """

    def __init__(
        self, model_path: Path | str, *, context_tokens: int = 512, min_score: float = 0.75
    ) -> None:
        self.min_score = min_score
        path = Path(model_path)
        if not path.is_file():
            raise ConfigError(f"no GGUF file at {path}; give LlamaEmbedder an existing model")
        try:
            llama_cpp = importlib.import_module("llama_cpp")
        except ImportError as exc:
            raise ConfigError(
                "LlamaEmbedder needs llama-cpp-python: pip install 'sandlot[local]'"
            ) from exc
        # One thread: the sandbox and the generating model want the other cores. n_batch equal
        # to the context, because llama.cpp embeds a text in one batch.
        self._llama: Any = llama_cpp.Llama(
            model_path=str(path),
            embedding=True,
            n_threads=1,
            n_ctx=context_tokens,
            n_batch=context_tokens,
            pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
            verbose=False,
        )
        self.dimensions: int = int(self._llama.n_embd())
        # A Llama context is not thread-safe, and embed() runs in worker threads.
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> list[list[float]]:
        with self._lock:
            raw: list[Any] = self._llama.embed(texts, truncate=True)
        return [_normalised(_mean_pooled(item)) for item in raw]

    def close(self) -> None:
        self._llama.close()


def _mean_pooled(embedding: Any) -> list[float]:
    # Models whose GGUF asks for no pooling answer one vector per token despite pooling_type.
    if embedding and isinstance(embedding[0], list):
        count = len(embedding)
        return [sum(column) / count for column in zip(*embedding, strict=True)]
    return [float(value) for value in embedding]


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

    def __init__(self, client: QdrantClient, embedder: Embedder, *, location: str) -> None:
        self._client = client
        self.embedder = embedder
        self.location = location
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    async def open(
        cls, settings: AgentSettings | None = None, embedder: Embedder | None = None
    ) -> Self:
        """Connect to the store the settings name and make sure the collection fits.

        Args:
            settings: Agent settings (default: :func:`get_agent_settings`). ``qdrant_url``
                selects a server; else embedded mode in ``qdrant_path`` or
                ``<data dir>/memory``.
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
        memory = cls(client, embedder, location=location)
        try:
            memory._locked(memory._ensure_collection)
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
        """Store one record; returns its point id (a UUID string)."""
        from qdrant_client import models

        [vector] = await asyncio.to_thread(self.embedder.embed, [record.task])
        point_id = str(uuid.uuid4())
        point = models.PointStruct(
            id=point_id, vector=vector, payload=record.model_dump(mode="json")
        )
        await self._call(self._client.upsert, COLLECTION_NAME, points=[point], wait=True)
        return point_id

    async def recall(
        self, task: str, limit: int = 3, min_score: float | None = None
    ) -> list[tuple[MemoryRecord, float]]:
        """The records most like ``task``, best first, with their cosine score.

        Solved records rank first at similar scores (``SOLVED_BONUS``); failures count only
        when they carry a fix. Records scoring below ``min_score`` are left out; by default
        the embedder's own ``min_score`` (scores mean different things per embedder), else
        ``DEFAULT_MIN_SCORE``.
        """
        if limit < 1:
            raise ConfigError(f"recall needs limit >= 1, got {limit}")
        if min_score is None:
            min_score = float(getattr(self.embedder, "min_score", DEFAULT_MIN_SCORE))
        [vector] = await asyncio.to_thread(self.embedder.embed, [task])
        response = await self._call(
            self._client.query_points,
            COLLECTION_NAME,
            query=vector,
            query_filter=_useful_records_filter(),
            limit=limit * CANDIDATES_PER_HIT,
            score_threshold=min_score,
            with_payload=True,
        )
        hits: list[tuple[MemoryRecord, float]] = []
        for point in response.points:
            try:
                hits.append((MemoryRecord.model_validate(point.payload), point.score))
            except ValidationError:
                # A shared server may hold points another version wrote; skip, do not fail.
                log.warning("memory_point_unreadable", point_id=str(point.id))
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
            self._client.delete_collection(COLLECTION_NAME)
            self._ensure_collection()

        await self._call(reset)

    async def close(self) -> None:
        """Release the client (and the embedded folder's lock). Idempotent."""
        if self._closed:
            return
        self._closed = True
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

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._closed:
            raise ConfigError("this AgentMemory is closed; open another with AgentMemory.open()")
        return await asyncio.to_thread(self._locked, function, *args, **kwargs)

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


def _useful_records_filter() -> models.Filter:
    from qdrant_client import models

    # Solved records, or failures that at least say what fixed an error.
    return models.Filter(
        should=[
            models.FieldCondition(key="outcome", match=models.MatchValue(value="solved")),
            models.Filter(
                must_not=[models.IsNullCondition(is_null=models.PayloadField(key="fix"))]
            ),
        ]
    )


def format_recall(
    hits: Sequence[tuple[MemoryRecord, float]], max_chars: int = RECALL_MAX_CHARS
) -> str:
    """A compact prompt section of recalled records, at most ``max_chars`` characters.

    Empty when there are no hits, so the caller can add it unconditionally. Code and texts are
    cut to fixed lengths; records that would overflow the budget are left out, except the
    best one, which is cut to fit.
    """
    if not hits:
        return ""
    header = "Similar past tasks (use what helps, ignore the rest):"
    sections: list[str] = []
    used_chars = len(header)
    for number, (record, score) in enumerate(hits, start=1):
        lines = [f"{number}. {_cut(record.task, RECALL_TEXT_MAX_CHARS)} (similarity {score:.2f})"]
        if record.errors:
            lines.append(f"   failed with: {_cut(record.errors[-1], RECALL_TEXT_MAX_CHARS)}")
        if record.fix:
            lines.append(f"   fixed by: {_cut(record.fix, RECALL_TEXT_MAX_CHARS)}")
        verdict = "worked" if record.outcome == "solved" else "last try, still failing"
        lines.append(f"   {verdict}:\n{_cut(record.code, RECALL_CODE_MAX_CHARS)}")
        section = "\n".join(lines)
        left_chars = max_chars - used_chars - 1
        if len(section) > left_chars:
            # The best hit is worth a cut; later ones are not worth crowding it.
            if sections or left_chars < RECALL_MIN_SECTION_CHARS:
                break
            section = _cut(section, left_chars)
        sections.append(section)
        used_chars += 1 + len(section)
    if not sections:
        return ""
    return "\n".join([header, *sections])


def _cut(text: str, max_chars: int) -> str:
    text = text.strip()
    if len(text) <= max_chars:
        return text
    return text[: max_chars - 4].rstrip() + " ..."
