"""What stands between a keyless server and the web pages its user visits.

With API keys on, a request needs a bearer key, which no page of another site can make a
browser send. With keys off (``serve --no-auth``, local single-user use) every request is
the local admin's, and a browser would lend that to any page: a page may post a form, a text
or an untyped body to another origin without asking first (no CORS preflight), open a
WebSocket to one (WebSockets have no CORS at all), and, with a DNS name it rebinds to
127.0.0.1, read the answers too. So a keyless server answers only requests addressed to one
of ``API_ALLOWED_HOSTS`` (the Host header, ``name[:port]`` and nothing else: a rebound name is
not one), and, where a browser says which page sent one (``Origin``), only the server's own
pages (the same scheme, name and port as the request's Host: its ``/docs``) or those named in
``API_ALLOWED_ORIGINS``. A page on another port of the same machine is another origin: a
notebook's output, a cloned project's dev server (it opened the agent's stream until
2026-12-07, red team). ``/mcp`` is checked here too.
"""

from __future__ import annotations

import re
from functools import cache
from urllib.parse import urlsplit

from sandlot.errors import Forbidden

# A Host header as browsers send it: a name or a bracketed IPv6 literal, and a port.
_AUTHORITY = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9.-]+))(?::(?P<port>\d{1,5}))?$"
)
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _authority(text: str) -> tuple[str, int | None] | None:
    """``name[:port]`` as (lowercased name, port or None); None if it is not that."""
    found = _AUTHORITY.match(text)
    if found is None:
        return None
    port = found["port"]
    return (found["v6"] or found["name"]).lower(), int(port) if port else None


@cache  # a setting's value: parsed once, not on every request
def _names(text: str) -> frozenset[str]:
    return frozenset(h.strip().lower().strip("[]") for h in text.split(",") if h.strip())


@cache
def _origins(text: str) -> frozenset[str]:
    return frozenset(origin.rstrip("/") for origin in _names(text))


def check_local(headers: object, allowed_hosts: str, allowed_origins: str = "") -> None:
    """Refuse a request to a keyless server that a page of another site could have made.

    Raises:
        Forbidden: its Host is not an allowed name, or its Origin not the server's own page
            nor an allowed origin.
    """
    allowed = _names(allowed_hosts)
    get = getattr(headers, "get")  # noqa: B009 - starlette's Headers and plain dicts alike
    host = get("host") or ""
    authority = _authority(host)
    if "*" not in allowed and (authority is None or authority[0] not in allowed):
        raise Forbidden(
            f"this server has no API keys (--no-auth), so it answers only requests "
            f"addressed to {', '.join(sorted(allowed))}, not {host!r}: a web page could "
            "reach it under another name. Add the name to API_ALLOWED_HOSTS, or turn keys on"
        )
    origin = get("origin")
    if origin is None:
        return  # not a browser's page: a client of its own (curl, the SDK)
    if origin.lower().rstrip("/") in _origins(allowed_origins):
        return
    parts = urlsplit(origin) if origin != "null" else None
    try:
        port = parts.port if parts is not None else None
    except ValueError:
        parts = None
    if parts is not None and parts.scheme in _DEFAULT_PORTS and authority is not None:
        own_port = authority[1] or _DEFAULT_PORTS[parts.scheme]
        if (parts.hostname, port or _DEFAULT_PORTS[parts.scheme]) == (authority[0], own_port):
            return  # the server's own page (its /docs)
    raise Forbidden(
        f"this server has no API keys (--no-auth), so it takes no request from a web page "
        f"of another origin (Origin {origin!r}; a page on another port is one). Name it in "
        "API_ALLOWED_ORIGINS, or turn keys on"
    )
