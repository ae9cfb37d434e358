"""Request and byte counters exposed at ``/metrics`` in the Prometheus text format.

Counters are per worker process; a scraper sums them across replicas.
"""

from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    """Thread-safe counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.bytes: Counter[str] = Counter()

    def count_request(self, method: str, route: str, status: int) -> None:
        """Count one finished request."""
        with self._lock:
            self.requests[(method, route, status)] += 1

    def add_bytes(self, direction: str, amount: int) -> None:
        """Count bytes received ('in') or sent ('out') as shard data."""
        with self._lock:
            self.bytes[direction] += amount

    def render(self, unsent_bytes: int = 0) -> str:
        """The counters, and the gauge of ``unsent_bytes`` (:class:`service.api.http.streaming.ByteBudget`),
        in Prometheus exposition format."""
        lines = [
            "# HELP ckptstore_requests_total HTTP requests by method, route and status.",
            "# TYPE ckptstore_requests_total counter",
        ]
        with self._lock:
            for (method, route, status), count in sorted(self.requests.items()):
                lines.append(f'ckptstore_requests_total{{method="{method}",route="{route}",status="{status}"}} {count}')
            lines += [
                "# HELP ckptstore_shard_bytes_total Shard bytes received (in) and sent (out).",
                "# TYPE ckptstore_shard_bytes_total counter",
            ]
            for direction in ("in", "out"):
                lines.append(f'ckptstore_shard_bytes_total{{direction="{direction}"}} {self.bytes[direction]}')
        lines += [
            "# HELP ckptstore_unsent_bytes Bytes of streamed answers read from storage, not yet taken by the clients.",
            "# TYPE ckptstore_unsent_bytes gauge",
            f"ckptstore_unsent_bytes {unsent_bytes}",
        ]
        return "\n".join(lines) + "\n"
