"""Embedders for the agent's vector memory (:mod:`sandlot.agent.memory`).

* :class:`HashingEmbedder`, the default, needs no dependency and no download. It measures
  *lexical* similarity (shared words, identifier parts, character 3-grams), not meaning.
* :class:`LlamaEmbedder` embeds with a GGUF model through llama-cpp-python (semantic, slower).
"""

from __future__ import annotations

import hashlib
import importlib
import math
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sandlot.errors import ConfigError

# Cosine scores below this are noise for HashingEmbedder: unrelated coding tasks share a few
# words or 3-grams and land below about 0.2; a rephrasing of the same task scores 0.35 and up.
DEFAULT_MIN_SCORE = 0.3


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
