"""Per-key rate limiting: a token bucket per API key, in memory (one server process)."""

from __future__ import annotations

import threading
import time

from sandlot.errors import RateLimited


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self._lock = threading.Lock()

    def check(self, key: str) -> None:
        """Take one token for ``key``.

        Raises:
            RateLimited: the bucket is empty; ``retry_after_s`` says when one token is back.
        """
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate_per_s)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                retry_after_s = (1.0 - tokens) / self.rate_per_s
                raise RateLimited(
                    f"over {self.rate_per_s:g} requests/s for this API key; retry in "
                    f"{retry_after_s:.2f} s or raise API_RATE_LIMIT_PER_SECOND",
                    retry_after_s=retry_after_s,
                )
            self._buckets[key] = (tokens - 1.0, now)
