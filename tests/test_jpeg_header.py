"""service.images.jpeg_header: a JPEG's size and EXIF orientation read without Pillow where the header is plain, and
left to Pillow (None) wherever Pillow could read it differently; upload_input's answer is Pillow's either way."""
import io
import random
import struct
import warnings

import numpy as np
import pytest
from PIL import Image
from service_process import photo_bytes

from repository import InputPolicy
from service.images.decode import decode, decode_size, model_input, upload_input
from service.core.errors import TooLarge
from service.images.jpeg_header import jpeg_header

POLICY = InputPolicy((96, 96), 110, "bicubic", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
SOS = b"\xff\xda"


def camera_jpeg(orientation: int | None = None, endian: str = "<", name: str = "chelsea", **tags) -> bytes:
    """A photo with a camera's EXIF: make, model and date, and the orientation if given, in either byte order."""
    exif = Image.Exif()
    exif.endian = endian
    exif.update({0x010F: "Maker", 0x0110: "Model X", 0x0132: "2026:11:27 10:00:00", **tags})
    if orientation is not None:
        exif[0x0112] = orientation
    return photo_bytes(name, "JPEG", quality=90, exif=exif.tobytes())


def pillows(data: bytes) -> tuple[int, int, int | None]:
    image = Image.open(io.BytesIO(data))
    return *image.size, image.getexif().get(0x0112)


@pytest.mark.parametrize("endian", ["<", ">"])
def test_plain_headers_read_as_pillow_reads_them(endian):
    cases = [camera_jpeg(o, endian) for o in (None, *range(1, 9))]
    cases += [camera_jpeg(6, endian, "camera"), photo_bytes("chelsea", "JPEG"), photo_bytes("camera", "JPEG")]
    for data in cases:
        assert jpeg_header(data) == pillows(data) is not None


@pytest.mark.filterwarnings("ignore:Truncated File Read")  # Pillow's, on the make past the segment
def test_headers_pillow_could_read_otherwise_are_left_to_it():
    exif = camera_jpeg(6)
    at = exif.index(b"Exif\0\0") - 4  # the APP1 marker
    length = struct.unpack(">H", exif[at + 2:at + 4])[0]
    second_exif = exif[:at + 2 + length] + exif[at:at + 2 + length] + exif[at + 2 + length:]  # Pillow joins them
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    unusual = {
        "XMP (Pillow reads an orientation there too)": photo_bytes("chelsea", "JPEG", xmp=xmp),
        "two Exif segments": second_exif,
        "the orientation as a LONG": camera_jpeg(),  # made below
        "CMYK": Image.fromarray(np.full((8, 8, 3), 90, np.uint8)).convert("CMYK"),
        "fill bytes before a marker": exif[:2] + b"\xff" + exif[2:],
        "a make whose text lies past the segment (Pillow stops reading the directory there)": camera_jpeg(6),
        "PNG": photo_bytes("chelsea", "PNG"),
        "not an image": b"\xff\xd8\xff this is not a JPEG",
    }
    long_orientation = Image.Exif()
    long_orientation[0x0112] = 6
    exif_bytes = bytearray(long_orientation.tobytes())  # Exif\0\0, MM\0*, the directory at 8: one entry
    exif_bytes[6 + 8 + 2 + 2:6 + 8 + 2 + 4] = b"\x00\x04"  # its type: LONG
    unusual["the orientation as a LONG"] = photo_bytes("chelsea", "JPEG", exif=bytes(exif_bytes))
    buffer = io.BytesIO()
    unusual["CMYK"].save(buffer, "JPEG")
    unusual["CMYK"] = buffer.getvalue()
    make = bytearray(unusual["a make whose text lies past the segment (Pillow stops reading the directory there)"])
    tiff = make.index(b"Exif\0\0") + 6
    make[tiff + 8 + 2 + 8:tiff + 8 + 2 + 12] = struct.pack("<L", 60000)  # the first entry's (Make's) data offset
    unusual["a make whose text lies past the segment (Pillow stops reading the directory there)"] = bytes(make)
    for what, data in unusual.items():
        assert jpeg_header(data) is None, what
    assert pillows(unusual["XMP (Pillow reads an orientation there too)"])[2] == 6
    assert pillows(unusual["a make whose text lies past the segment (Pillow stops reading the directory there)"]
                   )[2] is None
    for what in ("XMP (Pillow reads an orientation there too)", "two Exif segments", "the orientation as a LONG",
                 "a make whose text lies past the segment (Pillow stops reading the directory there)"):
        data = unusual[what]
        want = model_input(decode(data, POLICY.resize_short_side, 10**8).image, POLICY)
        np.testing.assert_array_equal(upload_input(data, POLICY, 10**8), want, what)


def test_damaged_headers_never_read_otherwise_than_pillow():
    """Random bytes of the header changed, 3,000 times: where this reads a header at all, it reads Pillow's size
    and orientation (or one Pillow refuses outright, which simplejpeg then decodes strictly or not at all)."""
    rng = random.Random(0)
    seeds = [camera_jpeg(o, endian) for o, endian in ((None, "<"), (3, "<"), (6, ">"), (8, ">"))]
    read = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's about corrupt EXIF data
        for _ in range(3000):
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(2, data.index(SOS))] = rng.choice([rng.randrange(256), 0, 1, 3, 0x12, 0xFF])
            ours = jpeg_header(bytes(data))
            try:
                theirs = pillows(bytes(data))
            except Exception:
                continue
            if ours is not None:
                read += 1
                assert ours == theirs, bytes(data[:data.index(SOS)]).hex()
    assert read > 1000  # most damage leaves the fields this reads alone


def test_a_plain_jpeg_is_neither_opened_by_pillow_nor_let_past_the_pixel_limit(monkeypatch):
    data = camera_jpeg(6)
    want = model_input(decode(data, POLICY.resize_short_side, 10**8).image, POLICY)
    monkeypatch.setattr(Image, "open", lambda *a, **kw: pytest.fail("Pillow opened a plain JPEG"))
    np.testing.assert_array_equal(upload_input(data, POLICY, 10**8), want)
    assert decode_size(data, 10**8) == (451, 300)
    for read in (lambda: upload_input(data, POLICY, 451 * 299), lambda: decode_size(data, 451 * 299)):
        with pytest.raises(TooLarge, match="135300 pixels"):
            read()
