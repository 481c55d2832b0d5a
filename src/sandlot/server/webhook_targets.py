"""Where a webhook may go: its URL taken apart (:func:`parse_target`) and each address its
host resolves to judged (:func:`address_refusal`): public, or in ``API_WEBHOOK_ALLOW_CIDRS``;
never loopback, private, CGNAT, link-local (cloud metadata), multicast, unspecified, reserved,
nor an IPv6 form that carries such an IPv4 address. ``webhooks.py`` checks every address, at
the command's start and at each try, and connects to the one it checked.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import httpx

from sandlot.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Not public, whatever Python's version says of them (3.11's ``is_global`` calls multicast
# global). Checked first, for the message; ``is_global`` is the backstop for anything new.
_REFUSED_V4: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "unspecified ('this network')"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "carrier-grade NAT (shared)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (cloud metadata services answer there)"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "IETF protocol"),
    ("192.0.2.0/24", "documentation"),
    ("192.88.99.0/24", "6to4 relay"),
    ("192.168.0.0/16", "private"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved (or broadcast)"),
)
_REFUSED_V6: tuple[tuple[str, str], ...] = (
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible (deprecated)"),
    ("64:ff9b:1::/48", "local NAT64"),
    ("100::/64", "discard-only"),
    ("2001::/23", "IETF protocol (Teredo and others)"),
    ("2001:db8::/32", "documentation"),
    ("fc00::/7", "unique local (private)"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
)
REFUSED_NETWORKS: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), what) for net, what in _REFUSED_V4 + _REFUSED_V6
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches through: IPv4-mapped (the host's own stack),
    NAT64's well-known prefix, 6to4."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def address_refusal(
    ip: IPAddress, allowed: list[IPNetwork] | tuple[IPNetwork, ...] = ()
) -> str | None:
    """Why a webhook may not go to ``ip`` ("loopback", "private", ...), or None: it is
    public, or inside one of the ``allowed`` networks (``API_WEBHOOK_ALLOW_CIDRS``). An IPv6
    address that carries an IPv4 one (mapped, NAT64, 6to4) is judged by that one."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    forms: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address) and (inner := _embedded_ipv4(ip)) is not None:
        forms.append(inner)
    if any(form in network for form in forms for network in allowed):
        return None
    judged = forms[-1]  # the IPv4 one an IPv6 form carries
    for network, what in REFUSED_NETWORKS:
        if judged in network:
            return what
    if not judged.is_global or judged.is_multicast or judged.is_reserved:
        return "not public"
    return None


@dataclass(frozen=True)
class Target:
    """A webhook URL taken apart: where to connect and what to say there."""

    scheme: str
    host: str  # ASCII (IDNA), lower case, no brackets
    port: int
    path: str  # path and query, as given
    host_header: str  # host[:port] as the URL names it
    literal: IPAddress | None  # the host, if it is an IP address

    def url_for(self, ip: IPAddress) -> str:
        """The URL that reaches ``ip``, the address checked, on the URL's port."""
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    def where(self) -> str:
        """What a log line may say of it: no path, no query (either may hold a token)."""
        return f"{self.scheme}://{self.host_header}"


def parse_target(url: str) -> Target:
    """``url`` taken apart for delivery.

    Raises:
        InvalidRequest: not an absolute http(s) URL with a host, or with credentials in it,
            a port out of range, or a space, control character or backslash anywhere.
    """
    if any(ord(c) <= 0x20 or ord(c) == 0x7F or c == "\\" for c in url):
        raise InvalidRequest("webhook_url must not hold spaces, control characters or '\\'")
    try:
        parsed = httpx.URL(url)
        raw_host = parsed.raw_host.decode("ascii")
    except (httpx.InvalidURL, UnicodeError, ValueError) as exc:
        raise InvalidRequest(f"webhook_url is not a valid URL: {exc}") from None
    scheme = parsed.scheme
    if scheme not in ("http", "https"):
        raise InvalidRequest("webhook_url must be an http:// or https:// URL")
    if parsed.userinfo:
        raise InvalidRequest("webhook_url must not hold credentials (user:password@)")
    if not raw_host:
        raise InvalidRequest("webhook_url names no host")
    port = parsed.port if parsed.port is not None else (443 if scheme == "https" else 80)
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"webhook_url's port {port} is out of range (1-65535)")
    try:
        literal: IPAddress | None = ipaddress.ip_address(raw_host)
    except ValueError:
        literal = None
    return Target(
        scheme=scheme,
        host=raw_host.lower(),
        port=port,
        path=parsed.raw_path.decode("ascii") or "/",
        host_header=parsed.netloc.decode("ascii"),
        literal=literal,
    )
