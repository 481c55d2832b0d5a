"""Prometheus metrics, fed by the manager's events (one registry per app, so tests can make
several apps in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sandlot.core import SandboxManager
from sandlot.models import ExecResult, SandboxInfo

WEBHOOK_OUTCOMES = ("delivered", "failed", "refused", "dropped", "cancelled")
EXEC_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, manager: SandboxManager) -> None:
        self.registry = CollectorRegistry()
        self.live = Gauge("sandlot_sandboxes_live", "Sandboxes alive now.", registry=self.registry)
        self.live.set_function(manager.live_count)
        self.created = Counter(
            "sandlot_sandboxes_created_total",
            "Sandboxes created.",
            ["backend"],
            registry=self.registry,
        )
        self.destroyed = Counter(
            "sandlot_sandboxes_destroyed_total",
            "Sandboxes destroyed, by why.",
            ["backend", "reason"],
            registry=self.registry,
        )
        self.kills = Counter(
            "sandlot_exec_kills_total",
            "Runs stopped, by kill_reason.",
            ["kill_reason"],
            registry=self.registry,
        )
        self.exec_seconds = Histogram(
            "sandlot_exec_duration_seconds",
            "Run time of code and commands.",
            ["kind"],
            buckets=EXEC_BUCKETS_S,
            registry=self.registry,
        )
        self.backend_errors = Counter(
            "sandlot_backend_errors_total",
            "Sandboxes that failed to start.",
            ["backend", "code"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "sandlot_http_requests_total",
            "HTTP requests, by route and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.webhook_deliveries = Counter(
            "sandlot_webhook_deliveries_total",
            "Background commands' webhooks, by outcome: delivered (a 2xx), failed (after "
            "its tries), refused (its host resolved to an address webhooks may not reach), "
            "dropped (its tenant had too many pending), cancelled (the server stopped).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in WEBHOOK_OUTCOMES:
            self.webhook_deliveries.labels(outcome)  # each shown, at 0, from the start
        manager.add_listener(self.on_event)

    def on_event(self, event: str, fields: dict[str, Any]) -> None:
        info: SandboxInfo | None = fields.get("info")
        if event == "created" and info is not None:
            self.created.labels(info.backend).inc()
        elif event == "destroyed" and info is not None:
            self.destroyed.labels(info.backend, info.end_reason or "unknown").inc()
        elif event == "exec":
            result: ExecResult = fields["result"]
            kind = "code" if fields["op"] == "exec_code" else "command"
            self.exec_seconds.labels(kind).observe(result.duration_ms / 1000)
            if result.kill_reason is not None:
                self.kills.labels(result.kill_reason).inc()
        elif event == "backend_error":
            self.backend_errors.labels(fields["backend"], fields["code"]).inc()
