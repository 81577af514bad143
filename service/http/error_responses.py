"""The HTTP edge of errors: every error is JSON {"error": {"code": ..., "message": ...}} with its status and
headers (Retry-After on 503s that have one). Under /v2 the Open Inference Protocol's own shape,
{"error": "<message>"}, which Triton's clients parse.
"""
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from service.core.errors import (BadInput, DeadlineExceeded, Forbidden, NotFound, ServiceError, TooLarge,
                                 Unauthenticated, Unavailable, UnsupportedMedia)

log = logging.getLogger("vitserve")

STATUS = {BadInput: 400, Unauthenticated: 401, Forbidden: 403, NotFound: 404, TooLarge: 413, UnsupportedMedia: 415,
          Unavailable: 503, DeadlineExceeded: 504}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   path: str = "") -> JSONResponse:
    error = message if path.startswith("/v2/") or path == "/v2" else {"code": code, "message": message}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def service_error_response(exc: ServiceError, path: str = "") -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return error_response(STATUS.get(type(exc), 500), exc.code, exc.message, headers, path)


_HTTP_CODES = {400: "bad_request", 403: "forbidden", 404: "not_found", 405: "method_not_allowed", 413: "too_large",
               415: "unsupported_media_type", 422: "invalid_request", 503: "unavailable"}


def answer_to(exc: Exception, method: str, path: str) -> JSONResponse:
    """The JSON answer to what a route raised; what is not the client's doing is logged. Exceptions of the kinds in
    HANDLED are answered where the route runs; others pass through the middleware (BodyLimit's own among them) to
    the outermost, ServerErrorMiddleware, which answers them here too, with a 500."""
    if isinstance(exc, ServiceError):
        if type(exc) not in STATUS:
            log.error("%s %s failed: %s", method, path, exc.message)
        return service_error_response(exc, path)
    if isinstance(exc, HTTPException):
        return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "error"), str(exc.detail),
                              getattr(exc, "headers", None), path)
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(422, "invalid_request", f"{where}: {first.get('msg')}".strip(": "), path=path)
    if isinstance(exc, ClientDisconnect):
        log.debug("%s %s: the client left during the upload", method, path)
        return error_response(499, "client_closed_request", "the client closed the connection", path=path)
    log.exception("%s %s failed", method, path, exc_info=exc)
    return error_response(500, "internal_error", f"the server failed: {type(exc).__name__}: {exc}", path=path)


HANDLED = (ServiceError, HTTPException, RequestValidationError, ClientDisconnect)


def install(app: FastAPI) -> None:
    """answer_to as FastAPI's handler of each kind of exception."""
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return answer_to(exc, request.method, request.url.path)

    for kind in (*HANDLED, Exception):
        app.add_exception_handler(kind, handle)
