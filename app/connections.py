"""Clients that hold a connection open without finishing a request (slowloris).

uvicorn closes an idle keep-alive connection a few seconds after a response, but a connection that never
completes its request head — opened and left silent, or fed one header byte at a time — stays open for as
long as the client likes: each costs a file descriptor and a little memory, and enough of them leave no
descriptor for real clients. ``RequestHeadDeadline`` is uvicorn's own HTTP/1.1 protocol with one rule added,
nginx's ``client_header_timeout``: the request line and headers must all arrive within ``head_timeout_s`` of
the connection opening (or of its previous response ending), else the connection is closed. A request body
that trickles in is the API's to time out (``api.BODY_TIMEOUT_S``). ``glimpse serve`` runs uvicorn with it
(``uvicorn.Config(http=RequestHeadDeadline)``, uvicorn's extension point for the protocol class).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 30.0  # nginx's client_header_timeout is 60 s; a real client sends its head in milliseconds


class RequestHeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11, which uvicorn brings), closing a connection whose request head has not
    all arrived ``head_timeout_s`` after the connection opened or its last response ended."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed): no deadline
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request's head

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()
