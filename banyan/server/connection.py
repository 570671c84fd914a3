"""uvicorn's HTTP/1.1 connection (h11), with the two deadlines uvicorn lacks (RELIABILITY H12, D4).

uvicorn only times out idle keep-alive connections. A client that sends its request at 1 byte/s
(slowloris) holds a connection, and for a body a task, for as long as it likes; a client that stops
reading a stream holds the connection while the response waits on it. Only the connection owns the
socket, so both deadlines are timers here rather than in the app:

    connection opens, or a request's first byte ──read timer──> the request has fully arrived
        fires: no headers yet  -> 408, close
               body still due  -> close; the handler reading the body sees a disconnect
    write buffer over its high-water mark (pause_writing) ──write timer──> resume_writing
        fires: drop the connection; the stream sees the disconnect and aborts its engine requests

The read timer is a deadline for the whole request, not an idle timeout: a byte a second would
reset an idle timer forever. Header size is capped by h11 itself (h11_max_incomplete_event_size in
launch.py, RELIABILITY H5): past it uvicorn answers 400 and closes.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from banyan.server.errors import APIError, error_body

logger = logging.getLogger("banyan.server")


class DeadlineH11Protocol(H11Protocol):
    """Use `DeadlineH11Protocol.with_timeouts(read, write)` as uvicorn's `http` protocol class."""

    read_timeout: float = 30.0
    write_timeout: float = 30.0

    @classmethod
    def with_timeouts(cls, read_timeout: float, write_timeout: float) -> type[DeadlineH11Protocol]:
        # uvicorn builds the protocol itself, with its own arguments: the timeouts travel on the class.
        return type(cls.__name__, (cls,), {"read_timeout": read_timeout, "write_timeout": write_timeout})

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._write_timer: asyncio.TimerHandle | None = None
        # A connection that never sends a byte is a slow request too.
        self._read_timer: asyncio.TimerHandle | None = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._read_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._read_timer = self._write_timer = None
        super().connection_lost(exc)

    # -- reading: the whole request within read_timeout ---------------------------------------
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already buffered
        self._update_read_timer()

    def _receiving(self) -> bool:
        """A request has begun to arrive and has not fully arrived."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _update_read_timer(self) -> None:
        if self.transport.is_closing():
            return
        receiving = self._receiving()
        if receiving and self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)
        elif not receiving and self._read_timer is not None and self.conn.their_state is not h11.IDLE:
            self._read_timer.cancel()  # all of it came (an IDLE connection keeps the timer it opened with)
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        logger.warning("closed a connection that did not send a whole request within %g s", self.read_timeout)
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:  # no request the app could answer
            self.transport.write(_request_timeout(self.read_timeout))
        self.transport.close()

    # -- writing: a client that reads nothing for write_timeout is dropped ---------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        logger.warning("dropped a connection whose client read nothing for %g s", self.write_timeout)
        self.transport.abort()  # what is buffered for it is discarded: that is the point


def _request_timeout(seconds: float) -> bytes:
    error = APIError(408, f"the request did not arrive within {seconds:g} s", code="request_timeout")
    body = json.dumps(error_body(error)).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
