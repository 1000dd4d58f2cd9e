"""Media URLs fetched with limits: the API's ``image_url``/``video_url`` parts, and the Ray captioner's manifests
of http(s) URLs.

Every fetch has a size cap and a deadline for the whole body however slowly it drips, follows redirects on the
same host only, and (unless allowed) refuses private, loopback, link-local and reserved addresses, so that a
request cannot make a server probe its own network (server-side request forgery). The address checked is the
address connected to: no second DNS lookup to rebind. Errors say what went wrong in words a client can act
on and nothing about the network behind.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterator
from urllib.parse import urljoin, urlsplit, urlunsplit

from glimpse.common import UserError

MAX_FETCH_BYTES = 50 * 2**20  # the API: an http(s) image or video larger than this is refused
FETCH_DEADLINE_S = 30.0  # the API: a media URL must be fetched within this, however slowly it drips


class FetchError(UserError):
    """A URL that could not be fetched within the limits (the API answers 400)."""


class Fetcher:
    """``fetch(url)``: the body as bytes; ``pieces(url)``: the body piece by piece (a large video written to a
    file never sits in memory whole). ``max_bytes`` and ``deadline_s`` bound every fetch; ``allow_private``
    lets it reach private, loopback and link-local addresses (a server's ``--allow-private-urls``; a dataset's
    own storage for the captioner)."""

    def __init__(self, allow_private: bool = False, deadline_s: float = FETCH_DEADLINE_S,
                 max_bytes: int = MAX_FETCH_BYTES):
        self.allow_private, self.deadline_s, self.max_bytes = allow_private, deadline_s, max_bytes

    def fetch(self, url: str) -> bytes:
        return b"".join(self.pieces(url))

    def pieces(self, url: str) -> Iterator[bytes]:
        import httpx

        deadline = time.monotonic() + self.deadline_s
        host = urlsplit(url).hostname
        try:
            for _ in range(5):  # redirects, on the same host only
                pinned, headers, extensions = self._pin(url)
                timeout = httpx.Timeout(min(10.0, self.deadline_s))
                with httpx.Client(timeout=timeout, follow_redirects=False) as client, \
                        client.stream("GET", pinned, headers=headers, extensions=extensions) as response:
                    if response.is_redirect:
                        target = urljoin(url, response.headers.get("location", ""))
                        if urlsplit(target).hostname != host:
                            raise FetchError(f"{url}: redirects to another host ({urlsplit(target).hostname})")
                        url = target
                        continue
                    response.raise_for_status()
                    size = 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        if size > self.max_bytes:
                            raise FetchError(f"{url}: larger than {self.max_bytes // 2**20} MiB")
                        if time.monotonic() > deadline:
                            raise FetchError(f"{url}: not fetched within {self.deadline_s:g} s")
                        yield chunk
                    return
            raise FetchError(f"{url}: too many redirects")
        except httpx.HTTPError:
            raise FetchError(f"{url}: could not be fetched") from None  # no detail: it would map the network

    def _pin(self, url: str) -> tuple[str, dict, dict]:
        """The URL with its host replaced by the address checked here, the Host header and TLS name of the
        original: the connection goes to the address that was checked, so a DNS answer that changes
        between the check and the connection (rebinding) cannot reach the server's own network."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchError(f"{url}: only http(s) URLs with a host are fetched")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise FetchError(f"{url}: could not be fetched") from None
        address = ipaddress.ip_address(infos[0][4][0].split("%")[0])
        if not self.allow_private:
            for info in infos:
                candidate = ipaddress.ip_address(info[4][0].split("%")[0])
                if (candidate.is_private or candidate.is_loopback or candidate.is_link_local or candidate.is_reserved
                        or candidate.is_multicast or candidate.is_unspecified):
                    raise FetchError(f"{url}: private, loopback and link-local addresses are not fetched "
                                     "(start the server with --allow-private-urls to allow them)")
        literal = f"[{address}]" if address.version == 6 else str(address)
        netloc = f"{literal}:{port}"
        host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        return pinned, {"Host": host_header}, {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
