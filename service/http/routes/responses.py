"""JSON bodies encoded once with the standard library: the routes build plain dicts, so FastAPI's
response_model (kept for the OpenAPI docs) need not validate and serialise them a second time."""
import json

from fastapi import Response

from service.pipeline.pipeline import Results


def json_response(body: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")).encode(), media_type="application/json", headers=headers)


def batch_and_timings(out: Results, total_ms: float) -> list[dict]:
    """Per image of a request, its `batch_size` and `timings_ms`, as /classify and /embed answer them."""
    return [{"batch_size": batch, "timings_ms": {"decode_ms": decode_ms, "queue_ms": queue_ms,
                                                 "inference_ms": inference_ms, "total_ms": total_ms}}
            for decode_ms, queue_ms, inference_ms, batch in zip(
                out.decode_ms, out.queue_ms.tolist(), out.inference_ms.tolist(), out.batch_size.tolist())]
