"""The HTTP + WebSocket service (``agent-sandbox serve``)."""

from agent_sandbox.server.app import create_app

__all__ = ["create_app"]
