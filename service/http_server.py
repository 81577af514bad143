"""uvicorn as the service runs it (`python -m service` and each worker of the process backend): its httptools
protocol with the request head bounded.

httptools has no bound of its own on a request line and headers: it gathers a header's value however long it
grows (by repeated concatenation), so a 64 MB header was read whole, for 7.7 s, while the worker's other clients
waited. Here a head past MAX_HEAD_BYTES is answered 431 (Request Header Fields Too Large), as nginx and Node
answer one past their 8-32 KiB, and its connection closed.
"""
import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .http_errors import error_response
from .settings import Settings

MAX_HEAD_BYTES = 16 * 1024  # Node's and h11's default; nginx's is 8 KiB a line, 32 KiB in all


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, counting the bytes received while a request's head is incomplete: past the
    bound, a 431 and the connection closed. A chunk in which a request ends is not counted (its head may have
    begun in it after a body): at most one chunk more than the bound is read.

    After the 431 the connection is closed for writing and what the client still sends is dropped, for at most
    LINGER_S seconds and LINGER_BYTES bytes (a "lingering close", as BodyLimit's), so that a client that sends
    before it reads gets the answer rather than a reset."""

    LINGER_S = 1.0
    LINGER_BYTES = 2**20

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._in_head, self._head_bytes, self._ended = True, 0, False
        self._dropping: int | None = None  # bytes still dropped after a 431

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        super().on_headers_complete()

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
        path = getattr(self, "url", b"").partition(b"?")[0].decode("latin-1")  # as far as it came: /v2's shape
        answer = error_response(431, "headers_too_large", f"the request line and headers are over {MAX_HEAD_BYTES} "
                                "bytes", path=path)
        head = b"".join(f"{k.decode()}: {v.decode()}\r\n".encode() for k, v in answer.raw_headers)
        self.transport.write(STATUS_LINE[431] + head + b"connection: close\r\n\r\n" + answer.body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._dropping = self.LINGER_BYTES
        asyncio.get_running_loop().call_later(self.LINGER_S, self.transport.close)


def server_options(settings: Settings, log_level: str) -> dict[str, Any]:
    """uvicorn's options for the service's HTTP server, as uvicorn.run and uvicorn.Config take them."""
    return {"http": BoundedHeadProtocol, "log_level": log_level, "access_log": settings.access_log,
            "timeout_graceful_shutdown": int(settings.request_timeout_s) + 5}
