"""The busiest routes without FastAPI's request machinery: POST /classify, POST /embed and
POST /v2/models/{name}[/versions/{v}]/infer are matched here, their query checked by the pydantic model FastAPI
documents, and their endpoint (the one FastAPI declares) called straight away; every other request goes on to
FastAPI's routing. The middleware (body limit, API key, metrics, cancel on disconnect) is the same for both: this is
the innermost. Errors get the same answers (error_responses.answer_to).

Why: FastAPI's exception middleware, routing, dependency solving and Request handling were a tenth of the HTTP
path's own CPU per /v2 request (docs/performance.md#the-http-path-against-a-bare-asgi-app).
"""
import re
from urllib.parse import parse_qsl

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp

from .error_responses import HANDLED, answer_to
from .routes import classify, embed, kserve

INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class HotRoutes:
    """ASGI middleware, the innermost: the hot routes served here, the rest by `rest` (FastAPI's exception middleware
    and routing)."""

    def __init__(self, rest: ASGIApp):
        self.rest = rest
        by_path: dict[str, BaseRoute] = {route.path: route for route in (
            *classify.router.routes, *embed.router.routes, *kserve.router.routes)}
        # what RequestMetrics labels a request by, as FastAPI's routing would have set it
        self.classify_route, self.embed_route = by_path["/classify"], by_path["/embed"]
        self.infer_routes = (by_path["/v2/models/{name}/infer"], by_path["/v2/models/{name}/versions/{version_}/infer"])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.rest(scope, receive, send)
        path = scope["path"]
        if path == "/classify":
            route, answer, args = self.classify_route, self._classify, ()
        elif path == "/embed":
            route, answer, args = self.embed_route, self._embed, ()
        elif path.startswith("/v2/models/") and (match := INFER.fullmatch(path)):
            route, answer, args = self.infer_routes[match[2] is not None], kserve.infer_version, match.groups()
        else:
            return await self.rest(scope, receive, send)
        scope["route"] = route
        try:
            response = await answer(Request(scope, receive), *args)
        except HANDLED as e:  # as FastAPI's ExceptionMiddleware would answer them
            response = answer_to(e, "POST", path)
        await response(scope, receive, send)

    @staticmethod
    async def _classify(request: Request) -> Response:
        return await classify.classify(request, query_model(classify.ClassifyQuery, request.scope["query_string"]))


    @staticmethod
    async def _embed(request: Request) -> Response:
        return await embed.embed(request, query_model(embed.EmbedQuery, request.scope["query_string"]))


def query_model(model: type[BaseModel], query_string: bytes) -> BaseModel:
    """The query string checked by `model`, as FastAPI checks a query parameter model: every value of a list field
    (labels=a&labels=b), the last of other repeated names; a refusal is FastAPI's 422, and so is a value that is
    not UTF-8."""
    lists = {name for name, field in model.model_fields.items() if "list" in str(field.annotation)}
    values: dict[str, str | list[str]] = {}
    try:
        for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True, errors="strict"):
            if name in lists:
                values.setdefault(name, []).append(value)
            else:
                values[name] = value
    except UnicodeDecodeError as e:
        raise RequestValidationError([{"loc": ("query",), "msg": f"not UTF-8: {e.reason} at byte {e.start}",
                                       "type": "unicode"}]) from None
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("query", *error["loc"])} for error in e.errors()]) from None
