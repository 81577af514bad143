"""Every error is JSON: {"error": {"code": ..., "message": ...}}, with the right status and headers.

Under /v2 the Open Inference Protocol's own shape, {"error": "<message>"}, which Triton's clients parse.
"""
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


log = logging.getLogger("vitserve")


class APIError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   path: str = "") -> JSONResponse:
    error = message if path.startswith("/v2/") or path == "/v2" else {"code": code, "message": message}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(503, "overloaded", message, {"Retry-After": str(retry_after_s)})


_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large",
               415: "unsupported_media_type", 422: "invalid_request", 503: "unavailable"}


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers, request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "error"), str(exc.detail),
                              getattr(exc, "headers", None), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(422, "invalid_request", f"{where}: {first.get('msg')}".strip(": "),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal_error", f"the server failed: {type(exc).__name__}: {exc}",
                              path=request.url.path)
