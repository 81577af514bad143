"""Multipart uploads, parsed from the whole body with python-multipart's streaming parser.

FastAPI's File parameters spool every part to a SpooledTemporaryFile and build UploadFile objects, which cost a
request more CPU than this (docs/performance.md#service-overhead-raw-session-vs-http). The body size is already
bounded by the BodyLimit middleware, so each part is kept as bytes.
"""
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from service.core.errors import BadInput, TooLarge


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, str | None, bytes]]:
    """(field name, filename, data) of every part of a multipart/form-data body."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        raise BadInput("send the image(s) as multipart/form-data", "no_image")
    parts, headers, name, value, data = [], {}, bytearray(), bytearray(), bytearray()

    def header_end() -> None:
        headers[bytes(name).lower()] = bytes(value)
        name.clear()
        value.clear()

    def part_end() -> None:
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        filename = disposition.get(b"filename")
        parts.append((disposition.get(b"name", b"").decode("latin-1"),
                      filename.decode("utf-8", "replace") if filename is not None else None, bytes(data)))
        headers.clear()
        data.clear()

    try:  # python-multipart refuses a boundary past 256 characters (RFC 2046: 70) as it is made: a 400 too
        parser = MultipartParser(params[b"boundary"], {
            "on_header_field": lambda d, s, e: name.extend(d[s:e]),
            "on_header_value": lambda d, s, e: value.extend(d[s:e]),
            "on_header_end": header_end,
            "on_part_data": lambda d, s, e: data.extend(d[s:e]),
            "on_part_end": part_end,
        })
        parser.write(body)
        parser.finalize()
    except FormParserError as e:  # MultipartParseError's base
        raise BadInput(f"the multipart body is malformed: {e}", "bad_request") from None
    return parts


async def read_images(request: Request, fields: tuple[str, ...], max_files: int) -> list[tuple[str | None, bytes]]:
    """The (filename, bytes) of the parts named one of `fields`, in order (read_uploads)."""
    return [(filename, data) for _, filename, data in await read_uploads(request, fields, max_files)]


async def read_uploads(request: Request, fields: tuple[str, ...], max_files: int
                       ) -> list[tuple[str, str | None, bytes]]:
    """The (field, filename, bytes) of the parts named one of `fields`, in order (images_of)."""
    return images_of(await form_parts(request), fields, max_files)


async def form_parts(request: Request) -> list[tuple[str, str | None, bytes]]:
    """Every part of the request's multipart body, (field, filename, bytes); none for an empty body."""
    content_type = request.headers.get("content-type", "")
    body = await request.body()
    return parse_multipart(body, content_type) if body or "multipart" in content_type else []


def images_of(parts: list[tuple[str, str | None, bytes]], fields: tuple[str, ...], max_files: int
              ) -> list[tuple[str, str | None, bytes]]:
    """The parts named one of `fields`, in order: every such part is an image (on routes that take one, a second is
    an error, not silently dropped). No image at all is 400 on every route."""
    images = [(field, filename, data) for field, filename, data in parts if field in fields]
    if not images:
        raise BadInput(f"send an image as the multipart field '{fields[0]}'"
                       + (f" (or several as '{fields[1]}')" if len(fields) > 1 else ""), "no_image")
    if len(fields) == 1 and len(images) > 1:  # a route with no field for several images takes one
        raise BadInput(f"{len(images)} '{fields[0]}' parts; this route takes one image per request", "one_image")
    if len(images) > max_files:
        raise TooLarge(f"{len(images)} images in one request; the limit is {max_files}", "too_many_files")
    return images


def texts_of(parts: list[tuple[str, str | None, bytes]], field: str) -> list[str]:
    """The values of the form's text fields named `field`, in order; BadInput for one that is not UTF-8."""
    texts = []
    for i, (_, _, data) in enumerate(part for part in parts if part[0] == field):
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BadInput(f"the form's {field} {i} is not UTF-8: {e.reason} at byte {e.start}", "not_utf8") from None
    return texts


def upload_body(fields: dict[str, str], several: str | None = None, texts: dict[str, str] | None = None) -> dict:
    """The OpenAPI requestBody of a multipart upload: `fields` one file each, `several` an array of files, `texts`
    arrays of strings."""
    properties = {name: {"type": "string", "format": "binary", "description": text} for name, text in fields.items()}
    if several:
        properties[several] = {"type": "array", "items": {"type": "string", "format": "binary"},
                               "description": "several images, each its own batch item"}
    for name, text in (texts or {}).items():
        properties[name] = {"type": "array", "items": {"type": "string"}, "description": text}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {
        "schema": {"type": "object", "properties": properties}}}}}
