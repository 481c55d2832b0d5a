"""The HTTP + WebSocket service (``sandlot serve``)."""

from sandlot.server.app import create_app

__all__ = ["create_app"]
