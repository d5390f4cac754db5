"""Who the client is behind a reverse proxy: ``X-Forwarded-For`` from trusted proxies only.

Per-client limits (``max_takes_per_client``) and logs key on the client's address. Behind a proxy
every connection comes from the proxy, so with ``trusted_proxies`` configured the middleware below
replaces ``request.remote`` with the address the proxies forwarded. The header is believed only
when the peer itself is a trusted proxy, and read from the right: each trusted hop vouches for
the one before it, and the first untrusted address is the client (whatever a client puts at the
left of the header is ignored).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from moss_rt.web.state import STATE

log = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or CIDR ranges (``10.0.0.0/8``, ``::1``); a bad entry is a configuration error."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"trusted_proxies: {entry!r} is not an IP address or network ({exc})") from None
    return tuple(networks)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # "[v6]:port"
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # "v4:port"
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    # An IPv4 peer on a dual-stack socket shows up as ::ffff:a.b.c.d.
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def _trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address, networks: tuple[Network, ...]) -> bool:
    return any(address.version == net.version and address in net for net in networks)


def client_address(peer: str | None, forwarded_for: Iterable[str], networks: tuple[Network, ...]) -> str | None:
    """The client's address for a connection from ``peer`` carrying these ``X-Forwarded-For`` values."""
    hop = _address(peer or "")
    if hop is None or not networks or not _trusted(hop, networks):
        return peer
    chain = [item for value in forwarded_for for item in value.split(",") if item.strip()]
    for item in reversed(chain):
        forwarded = _address(item)
        if forwarded is None:
            break  # garbage from an untrusted party: the last hop we could vouch for is the client
        hop = forwarded
        if not _trusted(hop, networks):
            break
    return str(hop)


@web.middleware
async def forwarded_for_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    networks = request.app[STATE].trusted_proxies
    if networks:
        client = client_address(request.remote, request.headers.getall("X-Forwarded-For", ()), networks)
        if client is not None and client != request.remote:
            request = request.clone(remote=client)
    return await handler(request)
