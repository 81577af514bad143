"""A JPEG's size and EXIF orientation, read without Pillow where its header is plain.

Pillow's `Image.open` and `getexif` parse a JPEG's markers and its EXIF directory in Python: 16 µs per upload
without EXIF and 35 with a camera's four tags, against 3.2 and 5.0 here (`bench/decode_speed.py`: libjpeg-turbo
reads the frame header, through simplejpeg, and the walk below reads the markers and one directory). Where the GPU
decodes, Pillow's read was a tenth to a fifth of an HTTP worker's CPU per image.

"Plain" is what cameras and encoders write: markers back to back up to the scan, at most one APP1 segment, an
Exif one, whose first directory holds the orientation as one SHORT or not at all. Anything else (XMP, where Pillow
also looks for an orientation; several Exif segments, which Pillow joins; fill bytes; an odd directory) gives
None, and Pillow reads the header as before: the answer is Pillow's wherever this one could differ from it.
"""
import struct

import simplejpeg

_COLOURS = ("YCbCr", "RGB", "Gray")  # what Pillow opens as RGB or L; CMYK and YCCK go to Pillow
_EXIF = b"Exif\0\0"
_SCAN, _APP1 = 0xDA, 0xE1
_ORDERS = {b"II*\0": "<", b"MM\0*": ">"}  # a TIFF header's byte order, as struct writes it
# bytes per value of TIFF's types 1-13 (BYTE, ASCII, SHORT, LONG, RATIONAL, SBYTE, UNDEFINED, SSHORT, SLONG,
# SRATIONAL, FLOAT, DOUBLE, IFD)
_TYPE_SIZES = dict(enumerate((1, 1, 2, 4, 8, 1, 1, 2, 4, 8, 4, 8, 4), start=1))


class _Unusual(Exception):
    """A header this module leaves to Pillow."""


def jpeg_header(data: bytes) -> tuple[int, int, int | None] | None:
    """(width, height, EXIF orientation or None) of a colour or grey JPEG whose header is plain, as Pillow reads
    them (`Image.open(...).size`, `getexif().get(0x0112)`); None for anything else, a non-JPEG included."""
    try:
        height, width, colours, _ = simplejpeg.decode_jpeg_header(data)
        if colours not in _COLOURS:
            return None
        exif = _exif_segment(data)
        return width, height, None if exif is None else _orientation(exif)
    except (ValueError, IndexError, struct.error, _Unusual):
        return None


def _exif_segment(data: bytes) -> bytes | None:
    """The TIFF data of the JPEG's one APP1 segment, an Exif one; None without APP1."""
    exif, at = None, 2  # past the start-of-image marker
    while (marker := _marker(data, at)) != _SCAN:
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if marker == _APP1:
            if exif is not None or data[at + 4:at + 10] != _EXIF:
                raise _Unusual
            exif = data[at + 10:at + 2 + length]
        at += 2 + length
    return exif


def _marker(data: bytes, at: int) -> int:
    """The marker at `at`: one with a length (fill bytes, and the markers that stand alone, are unusual here)."""
    if data[at] != 0xFF or (marker := data[at + 1]) == 0xFF or 0xD0 <= marker <= 0xD9 or marker in (0x00, 0x01):
        raise _Unusual
    return marker


def _orientation(tiff: bytes) -> int | None:
    """Tag 0x0112 of the first image directory, where it is one SHORT; None where the directory has none. Every
    entry's type must be TIFF's and its data within the segment, once each: where one's is not, Pillow skips the
    entry or stops reading the directory there, and it decides."""
    order = _ORDERS.get(tiff[:4])
    if order is None:
        raise _Unusual
    (at,) = struct.unpack_from(order + "L", tiff, 4)
    (count,) = struct.unpack_from(order + "H", tiff, at)  # struct.error past the end
    if at < 8 or at + 2 + 12 * count > len(tiff):
        raise _Unusual
    tags, found = set(), None
    for tag, kind, n, value in struct.iter_unpack(order + "HHLL", tiff[at + 2:at + 2 + 12 * count]):
        size = n * _TYPE_SIZES.get(kind, 0)
        if tag in tags or not size or (size > 4 and value + size > len(tiff)):
            raise _Unusual
        tags.add(tag)
        if tag == 0x0112:
            if (kind, n) != (3, 1):  # a SHORT, once
                raise _Unusual
            found = value & 0xFFFF if order == "<" else value >> 16  # the first two of the value's four bytes
    return found
