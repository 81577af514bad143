"""uvicorn as the service runs it (`python -m service` and each worker of the process backend): its httptools
protocol with the request head bounded, in size and in time, and each answer's head and body sent as one.

httptools has no bound of its own on a request line and headers: it gathers a header's value however long it
grows (by repeated concatenation), so a 64 MB header was read whole, for 7.7 s, while the worker's other clients
waited. Here a head past MAX_HEAD_BYTES is answered 431 (Request Header Fields Too Large), as nginx and Node
answer one past their 8-32 KiB, and its connection closed.

Nor does uvicorn time a request head: a client that trickles one byte at a time (slowloris), or opens a connection
and never sends a byte, held it for as long as it liked. Here a connection that has not sent a whole head
VITSERVE_HEADER_TIMEOUT_S after it opened, or after its last answer, is closed, with a 408 where part of one came,
as nginx does after client_header_timeout.
"""
import asyncio
import functools
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.core.settings import Settings

from .error_responses import error_response

MAX_HEAD_BYTES = 16 * 1024  # Node's and h11's default; nginx's is 8 KiB a line, 32 KiB in all


class WriteCombining:
    """A connection's transport whose writes in one turn of the event loop go out in one system call at its end
    (writelines: no copy). uvicorn writes an answer's status line and headers as soon as the app starts it, and its
    body in a second write; as one, an answer is one send and usually one TCP segment: 14% less CPU per /v2 request
    in an HTTP worker, 17% more requests a second (bench/http_floor.py, docs/performance.md). A close or an
    end-of-file sends what waits first; everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._waiting: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._waiting:
            self._loop.call_soon(self._send)
        self._waiting.append(data)

    def _send(self) -> None:
        waiting, self._waiting = self._waiting, []
        if waiting and not self._transport.is_closing():
            self._transport.writelines(waiting)

    def write_eof(self) -> None:
        self._send()
        self._transport.write_eof()

    def close(self) -> None:
        self._send()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, counting the bytes received while a request's head is incomplete: past the
    bound, a 431 and the connection closed. A chunk in which a request ends is not counted (its head may have
    begun in it after a body): at most one chunk more than the bound is read.

    After the 431 the connection is closed for writing and what the client still sends is dropped, for at most
    LINGER_S seconds and LINGER_BYTES bytes (a "lingering close", as BodyLimit's), so that a client that sends
    before it reads gets the answer rather than a reset."""

    LINGER_S = 1.0
    LINGER_BYTES = 2**20

    def __init__(self, *args: Any, header_timeout_s: float = 60.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._in_head, self._head_bytes, self._ended = True, 0, False
        self._dropping: int | None = None  # bytes still dropped after a 431
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(WriteCombining(transport, self.loop))
        self._time_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _time_head(self) -> None:
        """A whole request head is due within the timeout from now."""
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self._header_timeout_s, self._head_overdue)

    def _head_overdue(self) -> None:
        """Closed, where the connection still waits for a head (not while a request is handled: its answer starts
        the timer again): with a 408 where part of the head came."""
        handling = (self.cycle is not None and not self.cycle.response_complete) or self.pipeline
        if self.transport.is_closing() or not self._in_head or handling:
            return
        if self._head_bytes or getattr(self, "url", None):
            self._answer_and_close(408, "request_timeout", f"the request head did not come whole within "
                                   f"{self._header_timeout_s:g}s (VITSERVE_HEADER_TIMEOUT_S)")
        else:
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._time_head()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._ended = True, 0, True
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._dropping is not None:
            self._dropping -= len(data)
            if self._dropping < 0:
                self.transport.close()
            return
        self._ended = False
        super().data_received(data)
        if self._in_head and not self._ended and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse()

    def _refuse(self) -> None:
        self._answer_and_close(431, "headers_too_large", f"the request line and headers are over {MAX_HEAD_BYTES} "
                               "bytes")

    def _answer_and_close(self, status: int, code: str, message: str) -> None:
        """An error answered before the request's head was whole, then a lingering close."""
        path = (getattr(self, "url", None) or b"").partition(b"?")[0].decode("latin-1")  # as far as it came
        answer = error_response(status, code, message, path=path)
        head = b"".join(f"{k.decode()}: {v.decode()}\r\n".encode() for k, v in answer.raw_headers)
        self.transport.write(STATUS_LINE[status] + head + b"connection: close\r\n\r\n" + answer.body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._dropping = self.LINGER_BYTES
        asyncio.get_running_loop().call_later(self.LINGER_S, self.transport.close)


def server_options(settings: Settings, log_level: str) -> dict[str, Any]:
    """uvicorn's options for the service's HTTP server, as uvicorn.run and uvicorn.Config take them."""
    # An idle kept-alive connection is closed by the head timer alone, VITSERVE_HEADER_TIMEOUT_S after its last
    # answer. uvicorn's own 5 s close raced clients that reuse a connection idle about as long (httpx keeps one 5 s
    # from when it has read the answer, later than the server's clock starts): 33 of 2,700 such reuses got a reset
    # or no answer under load, none of 2,700 at 60 s (bench/keep_alive.py, docs/performance.md)
    return {"http": functools.partial(BoundedHeadProtocol, header_timeout_s=settings.header_timeout_s),
            "log_level": log_level, "access_log": settings.access_log,
            "timeout_keep_alive": settings.header_timeout_s,
            "timeout_graceful_shutdown": int(settings.request_timeout_s) + 5}
