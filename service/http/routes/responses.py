"""JSON bodies encoded once with the standard library: the routes build plain dicts, so FastAPI's
response_model (kept for the OpenAPI docs) need not validate and serialise them a second time."""
import json

from fastapi import Response


def json_response(body: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")).encode(), media_type="application/json", headers=headers)
