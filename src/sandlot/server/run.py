"""Run the server: uvicorn with the connection wall (:mod:`sandlot.server.transport`) and an
access log that never prints an API key."""

from __future__ import annotations

import logging
import re

from sandlot.config import Settings
from sandlot.server.connections import ConnectionCount, ConnectionLimits
from sandlot.server.transport import guarded_protocol

GRACEFUL_SHUTDOWN_S = 10  # uvicorn takes whole seconds
SECRET_QUERY = re.compile(r"((?:api_key|token)=)[^&\s\"]+", re.IGNORECASE)


class RedactSecrets(logging.Filter):
    """Replace ``?api_key=...`` (WebSocket clients may authenticate so) in access-log lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                SECRET_QUERY.sub(r"\1[redacted]", arg) if isinstance(arg, str) else arg
                for arg in record.args
            )
        record.msg = SECRET_QUERY.sub(r"\1[redacted]", str(record.msg))
        return True


def connection_limits(settings: Settings) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections=settings.max_connections,
        max_connections_per_ip=settings.max_connections_per_ip,
        header_timeout_s=settings.header_timeout_s,
        body_idle_timeout_s=settings.body_idle_timeout_s,
        max_header_bytes=settings.max_header_kb * 1024,
    )


def serve(settings: Settings) -> None:
    """Serve the API on ``settings.api_host:api_port`` until interrupted."""
    import uvicorn

    from sandlot.server.app import auth_failures_for, create_app

    logging.getLogger("uvicorn.access").addFilter(RedactSecrets())
    # One count of failed authentications by address: the app adds to it, the connection
    # wall closes the connections of an address out of credit before reading them.
    failures = auth_failures_for(settings)
    count = ConnectionCount(connection_limits(settings), auth_failures=failures)
    config = uvicorn.Config(
        create_app(settings, auth_failures=failures),
        host=settings.api_host,
        port=settings.api_port,
        log_level=settings.log_level.lower(),
        # uvicorn's own lines (its errors, the access log) go to the root logger's handler,
        # which configure_logging made: in LOG_FORMAT's lines, JSON too (its own config
        # printed them as console text whatever LOG_FORMAT said).
        log_config=None,
        http=guarded_protocol(count),
        ws="websockets-sansio",
        ws_max_size=settings.ws_max_message_kb * 1024,
        # No permessage-deflate: compressing each output frame was ~80% of the event loop's
        # time under a stream of output (py-spy, red team 2026-12-06), the server's CPU that
        # the guest's output budget does not count; a proxy in front may compress instead.
        ws_per_message_deflate=False,
        timeout_keep_alive=int(max(1, settings.keepalive_timeout_s)),
        loop=settings.api_event_loop,  # not uvicorn's "auto", which takes uvloop where installed
        # Requests still running this long after a stop are cancelled: an agent task or an
        # hour's long-poll held the server's exit until a second Ctrl-C (red team, 2026-12-06).
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    uvicorn.Server(config).run()
