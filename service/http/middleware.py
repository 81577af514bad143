"""ASGI middleware: HEAD as GET, the request-body limit, the API key, cancelling what a departed client asked for,
per-route request metrics, and (where traces are on) each request's span."""
import asyncio
import contextlib
import time
import zlib

from service.core import tracing
from service.core.api_key import check_key
from service.core.errors import BadInput, Unauthenticated
from service.core.metrics import Metrics, RequestCounter

from .error_responses import error_response


class HeadAsGet:
    """HEAD wherever GET is served (RFC 9110 requires it; FastAPI's GET routes answer it 405): the request runs as
    a GET and its answer goes out with the GET's status and headers, Content-Length included, and no body. A
    route without GET answers HEAD 405, as it answers GET. Every layer inside sees a GET: metrics count it as one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headless_send(message):
            await send({**message, "body": b""} if message["type"] == "http.response.body" else message)

        await self.app({**scope, "method": "GET"}, receive, headless_send)


class _BodyTooLarge(Exception):
    pass


# Content-Encodings of request bodies, as Triton takes them (tritonclient.http's request_compression_algorithm):
# zlib's window bits for each. HTTP's "deflate" is the zlib format (RFC 9110), as tritonclient sends it.
DECODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class BodyLimit:
    """413 for request bodies over the limit: at once from Content-Length, else while the body streams in,
    so an oversized upload is never buffered whole.

    A body sent with `Content-Encoding: gzip` or `deflate` is decompressed as it streams in, and its decompressed
    size is what counts: zlib is never asked for more than the limit's worth, so a decompression bomb costs
    nothing beyond it. Any other coding is a 415; a corrupt or cut compressed body, a 400.

    An answer given before the body was read (this 413, a 401 or 404 that needs no body) is followed by a
    lingering close, as nginx calls it: the rest of the body is read and dropped, for at most LINGER_S seconds
    and LINGER_BYTES bytes, before the answer ends. A client that sends its whole body before it reads, as
    Python's urllib does, then reads the answer, where a socket closed with unread data would have been reset
    under it. A client that asked `Expect: 100-continue` (curl) and was not told to go on sends nothing: none
    is waited for."""

    LINGER_S = 5.0
    LINGER_BYTES = 256 * 2**20

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def too_large(self, path: str, decompressed: bool = False):
        body = "the request body, decompressed," if decompressed else "the request body"
        return error_response(413, "too_large", f"{body} is over the {self.max_bytes}-byte limit", path=path)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        received, sent_bytes, read, started = 0, 0, False, False
        ended = length in (None, b"0") and b"transfer-encoding" not in headers  # no body at all
        expects_continue = headers.get(b"expect", b"").lower() == b"100-continue"
        coding = headers.get(b"content-encoding", b"").strip().lower().decode("latin-1")
        decoder = zlib.decompressobj(DECODINGS[coding]) if coding in DECODINGS else None
        path = scope.get("path", "")

        async def limited_receive():
            nonlocal received, sent_bytes, read, ended
            read = True
            message = await receive()
            ended = message["type"] != "http.request" or not message.get("more_body", False)
            if decoder is not None and message["type"] == "http.request":
                sent_bytes += len(message.get("body", b""))  # compressed, it is bounded too
                message = {**message, "body": _decompress(decoder, message.get("body", b""),
                                                          self.max_bytes - received, ended)}
            received += len(message.get("body", b""))
            if max(received, sent_bytes) > self.max_bytes:
                raise _BodyTooLarge
            return message

        async def lingering_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            waiting = expects_continue and not read  # told nothing, it sends nothing
            if message["type"] != "http.response.body" or message.get("more_body", False) or ended or waiting:
                return await send(message)
            await send({**message, "more_body": True})
            await self._discard(receive)
            await send({"type": "http.response.body", "body": b""})

        try:
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                await self.too_large(path)(scope, receive, lingering_send)
            elif decoder is None and coding not in ("", "identity") and not ended:
                await error_response(415, "unsupported_media_type", f"Content-Encoding {coding!r}: this server "
                                     f"takes {', '.join(DECODINGS)} or none", path=path)(scope, receive,
                                                                                         lingering_send)
            else:
                await self.app(scope if decoder is None else _decoded(scope), limited_receive, lingering_send)
        except _BodyTooLarge:
            if not started:
                await self.too_large(path, decoder is not None)(scope, receive, lingering_send)

    async def _discard(self, receive) -> None:
        """Read the request's body to its end, within the bounds."""
        dropped = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.LINGER_S):
                while dropped < self.LINGER_BYTES:
                    message = await receive()
                    dropped += len(message.get("body", b""))
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        return


def _decoded(scope: dict) -> dict:
    """The request as the app sees it once its body is decompressed: no coding, and no length (unknown)."""
    return {**scope, "headers": [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding",
                                                                                   b"content-length")]}


def _decompress(decoder, data: bytes, room: int, last: bool) -> bytes:
    """The next piece of a compressed body, at most room + 1 bytes (one past the limit says it is over, and a
    bomb is never inflated further). A corrupt or cut body, or one with data after its end, is a BadInput."""
    try:
        out = decoder.decompress(data, room + 1)
    except zlib.error as e:
        raise BadInput(f"the compressed request body is corrupt: {e}") from None
    if decoder.unused_data:  # not kept: it would grow with whatever follows
        raise BadInput("the compressed request body has data after its end")
    if last and not decoder.eof and len(out) <= room:
        raise BadInput("the compressed request body is cut short")
    return out


class ApiKey:
    """401 unless the request's X-API-Key header (or its Bearer token) holds the key (compared in constant time), on
    every route but the open ones: health, metrics, the API docs, the index and the v2 server metadata. New routes
    are closed until opened here."""

    OPEN_PREFIXES = ("/health/", "/v2/health/", "/metrics", "/docs", "/redoc", "/openapi.json")
    OPEN_PATHS = ("/", "/v2", "/v2/")  # /v2/ is /v2 (routes/kserve.py)

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.OPEN_PATHS or path.startswith(self.OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        try:
            check_key(given_key(dict(scope["headers"])), self.key,
                      "the X-API-Key header (or Authorization: Bearer, as OpenAI's clients send it)")
        except Unauthenticated as e:
            return await error_response(401, e.code, e.message, {"WWW-Authenticate": 'APIKey header="X-API-Key"'},
                                        path)(scope, receive, send)
        await self.app(scope, receive, send)


def given_key(headers: dict[bytes, bytes]) -> bytes:
    """The key a request sends: its X-API-Key header, else its Authorization: Bearer token (what the `openai`
    client sends, /v1/embeddings); nothing for neither."""
    if (key := headers.get(b"x-api-key")) is not None:
        return key
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class CancelOnDisconnect:
    """Cancels a request's handling when its client goes away once the body is in, so that its images leave the
    batcher's queue instead of being computed for nobody (a client that leaves mid-upload fails the body read).
    The handling runs in the request's own task, which a watcher cancels. The watcher starts WATCH_AFTER_S after the
    body is in, so that the many requests answered sooner never make one (a watcher for every request cost the HTTP
    path CPU: docs/performance.md#the-http-path-against-a-bare-asgi-app). A request that waits (in a queue under
    load, where a client is likeliest to give up) is watched from then on."""

    WATCH_AFTER_S = 0.02

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop, handling = asyncio.get_running_loop(), asyncio.current_task()
        gone, timer, watcher = False, None, None

        async def watch():
            nonlocal gone
            if (await receive())["type"] == "http.disconnect":  # after the answer, uvicorn says so at once
                gone = True
                handling.cancel()  # it waits on something (the watcher runs only then): it stops there

        def start_watching():
            nonlocal watcher
            watcher = loop.create_task(watch())

        async def tracked_receive():
            nonlocal timer
            message = await receive()
            if timer is None and (message["type"] != "http.request" or not message.get("more_body", False)):
                timer = loop.call_later(self.WATCH_AFTER_S, start_watching)
            return message

        try:
            await self.app(scope, tracked_receive, send)
        except asyncio.CancelledError:
            if not gone:  # cancelled from outside (shutdown), not by the client leaving: pass it on
                raise
            handling.uncancel()  # the task goes on, for the server's own ending of the request
        finally:
            if timer is not None:
                timer.cancel()
            if watcher is not None:
                watcher.cancel()


class RequestMetrics:
    """Counts requests by route template, method and status, and times them."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.count = app, RequestCounter(metrics)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def tracked_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            self.count(getattr(scope.get("route"), "path", "unmatched"), scope["method"], str(status),
                       time.perf_counter() - start)


class TraceRequests:
    """Each HTTP request as an OpenTelemetry server span, continuing the caller's trace from its `traceparent`
    (installed only where traces are on: tracing.py). Its task's spans (decode, queue) are the span's children."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
                   if name in (b"traceparent", b"tracestate")}
        with tracing.request_span(scope["method"], scope["path"], headers) as span:
            async def traced_send(message):
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, traced_send)
