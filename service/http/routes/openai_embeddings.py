"""POST /v1/embeddings: OpenAI's embeddings API, which the `openai` client, LangChain, LlamaIndex and vector databases'
loaders speak (https://platform.openai.com/docs/api-reference/embeddings).

Texts go through a whole CLIP's text tower; images, as `data:image/...;base64,` inputs, through a model's image
embedding (any model with one), into the same space where the model has both. Every vector is unit length, as
OpenAI's are; `dimensions` keeps the first that many and makes them unit length again (OpenAI's shortening).
A URL is refused: the server never fetches what a client names. Any input that fails fails the request, naming it
(the API has no per-input errors).
"""
import base64
import binascii
import re
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from service.core.errors import BadInput, TooLarge, UnsupportedMedia
from service.engine.heads import OUTPUTS_ONLY
from service.pipeline.pipeline import IMAGE_ERRORS, Pipeline
from service.pipeline.served import Pipelines
from service.pipeline.texts import normalized

from .embed import Encoding, encoded
from .responses import json_response

router = APIRouter(tags=["inference"])

DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.ASCII)
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.ASCII | re.IGNORECASE)


class EmbeddingsRequest(BaseModel):
    """OpenAI's request (its `user` accepted and unused)."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "clip", "input": ["a photo of a cat", "a photo of a dog"]}]})

    model: str | None = Field(None, description="model name (default: the server's default model)")
    input: StrictStr | list[StrictStr] = Field(
        description="a text, or a list of them; an image as a data:image/...;base64, URL (token arrays and web URLs "
                    "are not taken)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of floats per input; base64: its float32 little-endian bytes, base64")
    dimensions: int | None = Field(None, ge=1, description="keep the first this many dimensions, unit length again")
    user: str | None = Field(None, description="OpenAI's end-user id: accepted, not used")


def image_bytes(text: str, i: int) -> bytes | None:
    """An input's image, where it is a data URL (None for a text); BadInput or UnsupportedMedia for a URL, a data
    URL that is not base64 or not an image."""
    if (match := DATA_URL.match(text)) is None:
        if URL.fullmatch(text.strip()):
            raise BadInput(f"input {i} is a URL: the server never fetches what a client names; send the image as "
                           "data:image/...;base64,...", "url_input")
        return None
    media, params = match[1].lower(), match[2].lower().split(";")
    if not media.startswith("image/"):
        raise UnsupportedMedia(f"input {i} is a data URL of {media or 'no media type'}: only images "
                               "(data:image/...;base64,)", "unsupported_media_type")
    if "base64" not in params:
        raise BadInput(f"input {i} is a data URL without ;base64: images travel base64-encoded", "bad_data_url")
    try:
        return base64.b64decode(text[match.end():], validate=True)
    except binascii.Error as e:
        raise BadInput(f"input {i}: its base64 cannot be decoded ({e})", "bad_data_url") from None


async def image_vectors(pipeline: Pipeline, images: list[tuple[int, bytes]]) -> np.ndarray:
    """The images' embeddings, float32 [n, size]; the first that cannot be read fails the request, by its index."""
    try:
        out = await pipeline.images([data for _, data in images], OUTPUTS_ONLY)
    except IMAGE_ERRORS as e:  # every image failed: the last one's error is the request's
        raise type(e)(f"input {images[-1][0]}: {e.message}", e.code) from None
    for j, error in sorted(out.errors.items()):
        raise type(error)(f"input {images[j][0]}: {error.message}", error.code)
    return out.fields[pipeline.entry.embedding["output"]]


@router.post(
    "/v1/embeddings",
    summary="Embed texts and images (OpenAI's embeddings API)",
    description="OpenAI's request and answer: `{\"model\": M, \"input\": \"text\" | [\"t1\", ...]}` -> "
                "`{\"object\": \"list\", \"data\": [{\"object\": \"embedding\", \"index\": i, \"embedding\": [...]}], "
                "...}`. Texts need a whole CLIP (its text tower); images, as data URLs, any model with an "
                "embedding. Each vector is unit length.",
    responses={400: {"description": "an empty input or text, a control character, a URL, a data URL that is not "
                                    "base64, dimensions past the model's size, texts for a model without a text tower"},
               404: {"description": "unknown model"},
               413: {"description": "too many inputs or a text too long (VITSERVE_MAX_TEXTS, _MAX_TEXT_CHARS)"},
               415: {"description": "a data URL that is not an image"},
               422: {"description": "not the API's request: a number, nested lists, token arrays"},
               503: {"description": "overloaded or still loading"}},
)
async def embeddings(request: Request, body: EmbeddingsRequest) -> Response:
    pipelines: Pipelines = request.app.state.pipelines
    pipeline = pipelines.get(body.model)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if not inputs:
        raise BadInput("input is empty: send a text, or a list of them", "no_inputs")
    images = [(i, data) for i, text in enumerate(inputs) if (data := image_bytes(text, i)) is not None]
    texts = [(i, text) for i, text in enumerate(inputs) if not DATA_URL.match(text)]
    if len(images) > (most := pipelines.settings.max_files):
        raise TooLarge(f"{len(images)} images in one request; the limit is {most} (VITSERVE_MAX_FILES)",
                       "too_many_files")
    tower = pipeline.text_tower() if texts else None
    if images:
        pipeline.check_embedding()
    size = tower.size if tower else pipeline.entry.embedding["size"]
    if body.dimensions is not None and body.dimensions > size:
        raise BadInput(f"dimensions {body.dimensions} is past {pipeline.name}'s {size}", "bad_dimensions")
    vectors: list[np.ndarray | None] = [None] * len(inputs)
    tokens = 0
    if texts:
        found, counts = await tower.embed([text for _, text in texts])
        tokens = int(counts.sum())
        for (i, _), vector in zip(texts, found):
            vectors[i] = vector
    if images:
        for (i, _), vector in zip(images, await image_vectors(pipeline, images)):
            vectors[i] = vector
    out = normalized(np.stack(vectors)[:, :body.dimensions].astype(np.float32))
    encoding = Encoding.BASE64 if body.encoding_format == "base64" else Encoding.JSON
    data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(encoded(out, encoding))]
    return json_response({"object": "list", "data": data, "model": pipeline.name,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
