"""Media URLs fetched with limits: the API's ``image_url``/``video_url`` parts, and the Ray captioner's manifests
of http(s) URLs.

Every fetch has a size cap and one deadline for all of it — connecting, a response head sent a line at a time,
each redirect, the body however slowly it drips — follows redirects on the same host only, asks for the body
uncompressed and refuses one sent compressed anyway (a few kilobytes of brotli or nested gzip unpack to
gigabytes before a cap on what comes out could look), and (unless allowed) refuses every address that is not
globally reachable: private, loopback, link-local, shared (100.64/10, where some clouds answer metadata),
reserved, and IPv6 forms that carry one of those (IPv4-mapped, IPv4-compatible, 6to4, Teredo, NAT64), so that a
request cannot make a server probe its own network (server-side request forgery). The address checked is the
address connected to: no second DNS lookup to rebind. Errors say what went wrong in words a client can act
on and nothing about the network behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit, urlunsplit

from glimpse.common import UserError

MAX_FETCH_BYTES = 50 * 2**20  # the API: an http(s) image or video larger than this is refused
FETCH_DEADLINE_S = 30.0  # the API: a media URL must be fetched within this, however slowly it drips
MAX_REDIRECTS = 4
REDIRECTS = (301, 302, 303, 307, 308)  # what is followed (same host, http(s), at most MAX_REDIRECTS)
# IPv6 prefixes whose last 32 bits are an IPv4 address that the connection may end up at (IPv4-compatible, and
# the well-known NAT64 prefix of RFC 6052).
IPV4_CARRIERS = (ipaddress.ip_network("::/96"), ipaddress.ip_network("64:ff9b::/96"))
# Refused whatever Python's ``is_global`` says of them (which depends on the Python build: the CVE-2024-4032 fix
# changed it): IPv6 prefixes that tunnel to an IPv4 address — Teredo, 6to4 (deprecated, RFC 7526) and local-use
# NAT64 (RFC 8215), whose IPv4 address does not sit in the last 32 bits.
REFUSED_NETWORKS = (ipaddress.ip_network("2001::/32"), ipaddress.ip_network("2002::/16"),
                    ipaddress.ip_network("64:ff9b:1::/48"))


class FetchError(UserError):
    """A URL that could not be fetched within the limits (the API answers 400)."""


@dataclass
class Allowance:
    """What one request's media URLs may take in all: until ``deadline`` (``time.monotonic()``), ``max_bytes``
    bytes, and only while ``cancelled`` (its client left) is not set. A request of many URLs holds a worker no
    longer, and no more memory, than one large slow one would."""

    deadline: float
    max_bytes: int
    cancelled: threading.Event = field(default_factory=threading.Event)
    fetched: int = 0


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a server may fetch from ``address`` on a client's say-so: globally reachable, not multicast, not a
    tunnel prefix, and, for an IPv6 address that carries an IPv4 one, that one too."""
    if address.version == 6:
        if any(address in net for net in REFUSED_NETWORKS):
            return False
        carried = [address.ipv4_mapped]
        carried += [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) for net in IPV4_CARRIERS if address in net]
        if any(inner is not None and not is_public(inner) for inner in carried):
            return False
    return address.is_global and not address.is_multicast


class Fetcher:
    """``fetch(url)``: the body as bytes; ``pieces(url)``: the body piece by piece (a large video written to a
    file never sits in memory whole). ``max_bytes`` and ``deadline_s`` bound every fetch; ``allow_private``
    lets it reach private, loopback and link-local addresses (a server's ``--allow-private-urls``; a dataset's
    own storage for the captioner). A URL whose server answered with an error says its HTTP status; ``explain``:
    a connection that failed says why too (refused, reset) — for an operator's own manifest; a server's clients
    are told nothing that would map its network."""

    def __init__(self, allow_private: bool = False, deadline_s: float = FETCH_DEADLINE_S,
                 max_bytes: int = MAX_FETCH_BYTES, explain: bool = False):
        self.allow_private, self.deadline_s, self.max_bytes = allow_private, deadline_s, max_bytes
        self.explain = explain

    def fetch(self, url: str, allowance: Allowance | None = None) -> bytes:
        return b"".join(self.pieces(url, allowance))

    def pieces(self, url: str, allowance: Allowance | None = None) -> Iterator[bytes]:
        """The body piece by piece. The fetch runs on a private event loop in the calling thread, so that the
        deadline cancels whatever it waits on (a read timeout alone restarts with every byte that arrives).
        ``allowance``: what is left of the request's own (its URLs share one deadline and one byte budget, and
        a client that left stops them within half a second)."""
        own = time.monotonic() + self.deadline_s
        deadline = min(own, allowance.deadline if allowance else own)
        late = f"not fetched within {self.deadline_s:g} s"
        if deadline < own - 0.5:  # e.g. a request's later URL: it has what the earlier ones left of their time
            had = deadline - own + self.deadline_s
            late = (f"not fetched within the {had:.1f} s its request had left" if had > 0.05 else
                    "not fetched: its request's time for media URLs had run out")
        loop = asyncio.new_event_loop()
        chunks = self._chunks(url)
        waiting = None
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FetchError(f"{_shown(url)}: {late}")
                if allowance is not None and allowance.cancelled.is_set():
                    raise FetchError(f"{_shown(url)}: not fetched: the request was given up")
                waiting = waiting or asyncio.ensure_future(anext(chunks), loop=loop)
                # A slice at a time, so that a client that left is noticed between slices.
                done, _ = loop.run_until_complete(asyncio.wait({waiting}, timeout=min(remaining, 0.5)))
                if not done:
                    continue
                try:
                    chunk = waiting.result()
                except StopAsyncIteration:
                    return
                waiting = None
                if allowance is not None:
                    allowance.fetched += len(chunk)
                    if allowance.fetched > allowance.max_bytes:
                        raise FetchError(f"{_shown(url)}: the request's media URLs hold more than "
                                         f"{allowance.max_bytes // 2**20} MiB in all")
                yield chunk
        finally:
            if waiting is not None and not waiting.done():
                waiting.cancel()
                loop.run_until_complete(asyncio.gather(waiting, return_exceptions=True))
            loop.run_until_complete(chunks.aclose())  # closes the connection
            loop.run_until_complete(loop.shutdown_asyncgens())  # httpx's own readers, left by an early end
            loop.close()

    async def _chunks(self, url: str) -> AsyncIterator[bytes]:
        import httpx

        host = _split(url).hostname
        try:
            # No timeout of httpx's own: the deadline bounds every wait (a 10 s read timeout refused a server
            # that took 12 s to answer, under a deadline of 30 s, as "could not be fetched").
            async with httpx.AsyncClient(timeout=httpx.Timeout(None), follow_redirects=False) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    pinned, headers, extensions = await self._pin(url)
                    headers["Accept-Encoding"] = "identity"
                    async with client.stream("GET", pinned, headers=headers, extensions=extensions) as response:
                        if response.status_code in REDIRECTS:  # (a 304 is no redirect: nothing was asked of it)
                            url = _redirect_target(url, host, response.headers.get("location"))
                            continue
                        response.raise_for_status()
                        encoding = response.headers.get("content-encoding", "").strip().lower()
                        if encoding not in ("", "identity"):
                            raise FetchError(f"{_shown(url)}: the server sent the body compressed ({encoding}) "
                                             "although asked not to; it is not unpacked")
                        size = 0
                        async with contextlib.aclosing(response.aiter_raw()) as body:  # as sent: nothing unpacked
                            async for chunk in body:
                                size += len(chunk)
                                if size > self.max_bytes:
                                    raise FetchError(f"{_shown(url)}: larger than {self.max_bytes // 2**20} MiB")
                                yield chunk
                        return
            raise FetchError(f"{_shown(url)}: more than {MAX_REDIRECTS} redirects")
        except httpx.InvalidURL:
            raise FetchError(f"{_shown(url)}: not a valid URL") from None
        except httpx.HTTPStatusError as error:  # the server answered: its status is what the client can act on
            raise FetchError(f"{_shown(url)}: could not be fetched ({_cause(error)})") from None
        except httpx.HTTPError as error:
            # No detail of a connection that failed for a server's clients: refused, reset or unreachable would
            # map the network.
            why = f" ({_cause(error)})" if self.explain else ""
            raise FetchError(f"{_shown(url)}: could not be fetched{why}") from None

    async def _pin(self, url: str) -> tuple[str, dict, dict]:
        """The URL with its host replaced by the address checked here, the Host header and TLS name of the
        original: the connection goes to the address that was checked, so a DNS answer that changes
        between the check and the connection (rebinding) cannot reach the server's own network."""
        parts = _split(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchError(f"{_shown(url)}: only http(s) URLs with a host are fetched")
        port = parts.port or (443 if parts.scheme == "https" else 80)  # checked by _split
        try:  # in a worker thread of the loop: the deadline bounds a slow DNS answer too
            infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise FetchError(f"{_shown(url)}: could not be fetched") from None
        address = ipaddress.ip_address(infos[0][4][0].split("%")[0])
        if not self.allow_private:
            if not all(is_public(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos):
                raise FetchError(f"{_shown(url)}: private, loopback and link-local addresses are not fetched "
                                 "(start the server with --allow-private-urls to allow them)")
        literal = f"[{address}]" if address.version == 6 else str(address)
        netloc = f"{literal}:{port}"
        host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        return pinned, {"Host": host_header}, {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}


def _split(url: str):
    """``urlsplit``, its complaints (a port out of range, a broken IPv6 literal) said as a refusal of the URL."""
    try:
        parts = urlsplit(url)
        if parts.port == 0:  # no server listens there; "or 80" would have fetched the default port instead
            raise ValueError("port 0")
        return parts
    except ValueError:
        raise FetchError(f"{_shown(url)}: not a valid URL") from None


def _shown(url: str) -> str:
    """A URL as an error quotes it: its first 200 characters (a 1 MB URL came back whole in its error)."""
    return url if len(url) <= 200 else url[:200] + "…"


def _redirect_target(url: str, host: str | None, location: str | None) -> str:
    """Where a redirect of ``url`` leads, if it may be followed: an http(s) URL on the same host."""
    if not location:
        raise FetchError(f"{_shown(url)}: redirects without saying where (no Location)")
    target = urljoin(url, location)
    parts = _split(target)
    if parts.scheme not in ("http", "https"):
        raise FetchError(f"{_shown(url)}: redirects to a URL that is not http(s)")
    if parts.hostname != host:
        raise FetchError(f"{_shown(url)}: redirects to another host ({parts.hostname})")
    return target


def _cause(error) -> str:
    """Why a fetch failed, in a few words: the HTTP status, or the kind of network error."""
    import httpx

    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code} {error.response.reason_phrase}".strip()
    if isinstance(error, httpx.ConnectError):  # httpx says "All connection attempts failed"
        return f"could not connect: refused or unreachable ({error})" if str(error) else "could not connect"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
