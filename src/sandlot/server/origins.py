"""What stands between a keyless server and the web pages its user visits.

With API keys on, a request needs a bearer key, which no page of another site can make a
browser send. With keys off (``serve --no-auth``, local single-user use) every request is
the local admin's, and a browser would lend that to any page: a page may post a form, a text
or an untyped body to another origin without asking first (no CORS preflight), open a
WebSocket to one (WebSockets have no CORS at all), and, with a DNS name it rebinds to
127.0.0.1, read the answers too. So a keyless server answers only requests addressed to one
of ``API_ALLOWED_HOSTS`` (the Host header: a rebound name is not one) whose ``Origin``, where
a browser sent one, names one of them too. ``/mcp`` does the same with the MCP SDK's own
check.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from sandlot.errors import Forbidden


def _hostname(authority: str) -> str | None:
    """The host of ``host[:port]`` (``[v6]:port`` too), lowercased; None if it is not one."""
    try:
        name = urlsplit(f"//{authority}").hostname
    except ValueError:
        return None
    return name


def check_local(headers: object, allowed_hosts: str) -> None:
    """Refuse a request to a keyless server that a page of another site could have made.

    Raises:
        Forbidden: its Host is not an allowed name, or its Origin is not an allowed one.
    """
    allowed = {h.strip().lower().strip("[]") for h in allowed_hosts.split(",") if h.strip()}
    if "*" in allowed:
        return
    get = getattr(headers, "get")  # noqa: B009 - starlette's Headers and plain dicts alike
    host = get("host") or ""
    if _hostname(host) not in allowed:
        raise Forbidden(
            f"this server has no API keys (--no-auth), so it answers only requests "
            f"addressed to {', '.join(sorted(allowed))}, not {host!r}: a web page could "
            "reach it under another name. Add the name to API_ALLOWED_HOSTS, or turn keys on"
        )
    origin = get("origin")
    if origin is None:
        return  # not a browser's page: a client of its own (curl, the SDK)
    parts = urlsplit(origin) if origin != "null" else None
    if parts is None or parts.scheme not in ("http", "https") or parts.hostname not in allowed:
        raise Forbidden(
            f"this server has no API keys (--no-auth), so it takes no request from a web "
            f"page of another site (Origin {origin!r}). Add the page's host name to "
            "API_ALLOWED_HOSTS, or turn keys on"
        )
