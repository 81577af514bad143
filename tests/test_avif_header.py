"""service/images/avif_header.py against the files it meets: real AVIFs (Pillow's encoder, libavif and libaom, of
scikit-image's photos), the same AV1 data rebuilt into other boxes by a small ISOBMFF writer (grids, idat, iloc
versions 1 and 2, alpha), and hostile ones (issue 73): a thousand items over 2 MB, an OBU flood, frames that
override their size, a later sequence header. Each rebuilt file libavif decodes is decoded here too, so that the
writer writes what libavif reads."""
import dataclasses
import functools
import io
import struct
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from skimage import data as photos

from service.core.errors import TooLarge
from service.images.avif_header import largest_frame
from service.images.decode import decode_size

REFERENCE = Path(__file__).parent / "reference"
ALPHA_URN = b"urn:mpeg:mpegB:cicp:systems:auxiliary:alpha\0"


# -- the writer ------------------------------------------------------------------------------------------------------

def box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, *parts: bytes, flags: int = 0) -> bytes:
    return box(kind, struct.pack(">I", version << 24 | flags), *parts)


def ispe(width: int, height: int) -> bytes:
    return full_box(b"ispe", 0, struct.pack(">II", width, height))


@dataclass
class Item:
    id: int
    type: bytes = b"av01"
    data: bytes = b""
    properties: tuple[bytes, ...] = ()
    idat: bool = False  # its data in the meta box's idat box (construction method 1), not in mdat
    extents: tuple[tuple[int, int], ...] | None = None  # (offset, length) from where its data lies; None: its data


def avif(items: list[Item], refs: tuple[tuple[bytes, int, tuple[int, ...]], ...] = (), primary: int = 1,
         iloc_version: int = 1, padding: int = 0) -> bytes:
    """An AVIF of these items (the primary first by default), (type, from, to) references, and `padding` zero bytes
    after the items' data in mdat."""
    places, mdat, idat = {}, b"", b""
    for item in items:
        places[item.id] = len(idat) if item.idat else len(mdat)
        if item.idat:
            idat += item.data
        else:
            mdat += item.data
    ftyp = box(b"ftyp", b"avif", bytes(4), b"avifmif1miaf")
    size = len(ftyp) + len(_meta(items, refs, primary, iloc_version, places, idat, 0)) + 8
    return ftyp + _meta(items, refs, primary, iloc_version, places, idat, size) + box(b"mdat", mdat, bytes(padding))


def _meta(items, refs, primary, iloc_version, places, idat, mdat_start) -> bytes:
    wide = ">I" if iloc_version == 2 else ">H"
    infe = [full_box(b"infe", 3 if iloc_version == 2 else 2, struct.pack(wide, item.id), bytes(2), item.type, b"\0")
            for item in items]
    iinf = full_box(b"iinf", 1, struct.pack(">I", len(items)), *infe)
    entries = []
    for item in items:
        assert iloc_version or not item.idat, "construction methods come with iloc version 1"
        extents = item.extents if item.extents is not None else ((0, len(item.data)),)
        entries.append(struct.pack(wide, item.id) + (struct.pack(">H", item.idat) if iloc_version else b"")
                       + struct.pack(">HIH", 0, places[item.id] + (0 if item.idat else mdat_start), len(extents))
                       + b"".join(struct.pack(">II", *extent) for extent in extents))
    iloc = full_box(b"iloc", iloc_version, bytes([0x44, 0x40]), struct.pack(wide, len(items)), *entries)
    iref = full_box(b"iref", 0, *(box(kind, struct.pack(f">HH{len(to)}H", source, len(to), *to))
                                  for kind, source, to in refs)) if refs else b""
    properties = list(dict.fromkeys(p for item in items for p in item.properties))
    ipma = [struct.pack(">HB", item.id, len(item.properties)) + bytes(properties.index(p) + 1 for p in item.properties)
            for item in sorted(items, key=lambda item: item.id) if item.properties]  # (in order, as libavif wants)
    iprp = box(b"iprp", box(b"ipco", *properties), full_box(b"ipma", 0, struct.pack(">I", len(ipma)), *ipma))
    hdlr = full_box(b"hdlr", 0, bytes(4), b"pict", bytes(12), b"\0")
    pitm = full_box(b"pitm", 0, struct.pack(">H", primary))
    return full_box(b"meta", 0, hdlr, pitm, iloc, iinf, iref, iprp, box(b"idat", idat) if idat else b"")


def _children(data: bytes, start: int, end: int) -> dict[bytes, tuple[int, int]]:
    found = {}
    while start < end:
        size, kind = struct.unpack_from(">I4s", data, start)
        found.setdefault(kind, (start + 8, start + size))
        start += size
    return found


@dataclass(frozen=True)
class Still:
    """A single-image AVIF from Pillow, in parts: its AV1 data (mdat's, all of it) and its item's properties."""
    file: bytes
    payload: bytes
    properties: tuple[bytes, ...]

    def item(self, id: int, **fields) -> Item:
        return Item(id, **{"data": self.payload, "properties": self.properties, **fields})


def still(image: Image.Image, **options) -> Still:
    buf = io.BytesIO()
    image.save(buf, "AVIF", speed=10, **options)
    data = buf.getvalue()
    top = _children(data, 0, len(data))
    meta = _children(data, top[b"meta"][0] + 4, top[b"meta"][1])
    start, end = _children(data, *meta[b"iprp"])[b"ipco"]
    properties = []
    while start < end:
        size, = struct.unpack_from(">I", data, start)
        properties.append(data[start:start + size])
        start += size
    return Still(data, data[slice(*top[b"mdat"])], tuple(properties))


@functools.cache
def astronaut() -> Still:
    return still(Image.fromarray(photos.astronaut()), quality=60)


@functools.cache
def bomb() -> Still:
    """12000 x 12000 grey (tests/reference/make_bomb_references.py): 144 MP of frame in 2 KB."""
    data = (REFERENCE / "flat_12000.avif").read_bytes()
    top = _children(data, 0, len(data))
    meta = _children(data, top[b"meta"][0] + 4, top[b"meta"][1])
    start, end = _children(data, *meta[b"iprp"])[b"ipco"]
    av1c = _children(data, start, end)[b"av1C"]
    return Still(data, data[slice(*top[b"mdat"])], (ispe(512, 512), data[av1c[0] - 8:av1c[1]]))


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# -- the AV1 bits ----------------------------------------------------------------------------------------------------

def bits(*fields: tuple[int, int]) -> bytes:
    """(value, width) fields, most significant bit first, then trailing_bits (a one, zeros to the byte)."""
    value, width = 0, 0
    for field, size in fields:
        assert 0 <= field < 1 << size
        value, width = value << size | field, width + size
    value, width = value << 1 | 1, width + 1
    return (value << (-width % 8)).to_bytes(-(-width // 8), "big")


def obu(kind: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([kind << 3 | 2, len(payload)]) + payload


SEQUENCE, FRAME_HEADER, FRAME, PADDING = 1, 3, 6, 15
KEY, INTER, SWITCH = 0, 1, 3


def reduced_sequence(width: int, height: int) -> bytes:
    return obu(SEQUENCE, bits((0, 3), (1, 1), (1, 1), (8, 5), (15, 4), (15, 4), (width - 1, 16), (height - 1, 16)))


def full_sequence(width: int, height: int, size_bits: int = 16, timing: bool = False, equal_interval: bool = False,
                  decoder_model: bool = False, frame_ids: bool = False, choose_tools: bool = True) -> bytes:
    """A sequence header that is no reduced still picture header, with the fields that place a frame header's
    frame_size_override_flag: timing and decoder model info (a 16-bit presentation time), frame ids (13 bits),
    screen content tools and integer motion vectors chosen by each frame or not."""
    fields = [(0, 3), (0, 1), (0, 1), (timing, 1)]
    if timing:
        fields += [(1, 32), (30, 32), (equal_interval, 1)] + [(0b00100, 5)] * equal_interval  # uvlc: 3
        fields += [(decoder_model, 1)] + [(9, 5), (1, 32), (7, 5), (15, 5)] * decoder_model  # 10-bit delays
    fields += [(1, 1), (1, 5)]  # initial_display_delay_present_flag, two operating points
    for idc in (0x103, 0x101):
        fields += [(idc, 12), (9, 5), (0, 1)] + [(1, 1), (5, 10), (6, 10), (0, 1)] * decoder_model + [(1, 1), (3, 4)]
    fields += [(size_bits - 1, 4), (size_bits - 1, 4), (width - 1, size_bits), (height - 1, size_bits)]
    fields += [(frame_ids, 1)] + [(6, 4), (4, 3)] * frame_ids  # delta 8 bits, idLen 8 + 5 = 13
    fields += [(0, 3), (0, 4), (1, 1), (1, 2)]  # superblock, filters; compound, warped, dual; order hint, its tools
    fields += [(1, 1), (1, 1)] if choose_tools else [(0, 1), (1, 1), (0, 1), (0, 1)]  # screen content, integer mv
    return obu(SEQUENCE, bits(*fields, (6, 3)))


def frame_header(override: bool, frame_type: int = KEY, shown: bool = True, presentation: bool = False,
                 frame_ids: bool = False, choose_tools: bool = True, kind: int = FRAME_HEADER) -> bytes:
    """A frame header up to its frame_size_override_flag, and a few bits of what follows, for `full_sequence`."""
    fields = [(0, 1), (frame_type, 2), (shown, 1)]
    fields += ([(12345, 16)] * presentation) if shown else [(1, 1)]
    fields += [] if frame_type == SWITCH or (frame_type == KEY and shown) else [(0, 1)]
    fields += [(0, 1)] + [(1, 1), (1, 1)] * choose_tools + [(77, 13)] * frame_ids  # cdf; tools, integer mv; id
    fields += [] if frame_type == SWITCH else [(override, 1)]
    return obu(kind, bits(*fields, (0, 7)))


def only_item(payload: bytes) -> bytes:
    return avif([Item(1, data=payload, properties=astronaut().properties)])


# -- the tests -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("iloc_version", "in_idat"), [(0, False), (1, False), (1, True), (2, False), (2, True)])
def test_a_still_rebuilt_in_other_boxes_is_decoded_by_libavif_and_sized_alike(iloc_version, in_idat):
    """The same AV1 data in the file or in the meta box's idat (construction method 1, iloc versions 1 and 2), in one
    extent or three: libavif decodes the same pixels, and its frame is the photo's size."""
    photo = astronaut()
    whole = photo.item(1, idat=in_idat)
    cut = len(photo.payload) // 3
    split = photo.item(1, idat=in_idat, extents=((0, cut), (cut, cut), (2 * cut, len(photo.payload) - 2 * cut)))
    for item in (whole, split):
        data = avif([item], iloc_version=iloc_version)
        assert largest_frame(data) == (512, 512)
        np.testing.assert_array_equal(decoded(data), decoded(photo.file))


@functools.cache
def thousand_items() -> bytes:
    """The photo, and 1,000 other av01 items over 2 MB (issue 73): each an infe entry, and an iloc entry whose extent
    length 0 the former walk read as "to the end of the file". libavif reads it as 0 bytes, and decodes the photo."""
    photo = astronaut()
    others = [Item(id, extents=((0, 0),)) for id in range(2, 1002)]
    return avif([photo.item(1), *others], padding=2_000_000 - len(photo.payload))


def walked(data: bytes) -> tuple[tuple[int, int] | Exception, float, int]:
    """largest_frame's answer (or its ValueError), its time, and the peak of Python's memory while it ran."""
    start = time.perf_counter()
    try:
        answer = largest_frame(data)
    except ValueError as e:
        answer = e
    took = time.perf_counter() - start
    tracemalloc.start()
    try:
        largest_frame(data)
    except ValueError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return answer, took, peak


def test_a_thousand_items_over_2_mb_cost_neither_memory_nor_time():
    """Before: 1,000 copies of the rest of the file, 1.9 GB of Python's memory and 1.2-2.7 s (the server's answer:
    2.3 s, +1,866 MB). Now the primary image alone is read: a few KB beside the 2 MB upload, and milliseconds. Items
    located to the end of the file by their length are never read either."""
    data = thousand_items()
    assert len(data) > 2_000_000
    answer, took, peak = walked(data)
    assert answer == (512, 512)
    assert peak < len(data) // 20 and took < 0.25, (peak, took)  # (measured: 3 KB and 3 ms)
    np.testing.assert_array_equal(decoded(data), decoded(astronaut().file))  # libavif decodes it: a 200
    others = [Item(id, extents=((0, 2_000_000),)) for id in range(2, 1002)]
    assert walked(avif([astronaut().item(1), *others], padding=2_000_000))[0] == (512, 512)


def test_an_obu_flood_is_refused_at_once_and_a_few_padding_obus_are_not():
    """A million padding OBUs (two bytes each) before the photo's: refused after 260 (4 an image and 256 more), not
    walked; 250 of them, which dav1d skips as it should, are read through."""
    photo = astronaut()
    flood = only_item(obu(PADDING, b"") * 1_000_000 + photo.payload)
    answer, took, peak = walked(flood)
    assert isinstance(answer, ValueError) and "OBUs" in str(answer)
    assert took < 0.25 and peak < 100_000, (took, peak)  # (measured: under 1 ms and 3 KB)
    padded = only_item(obu(PADDING, b"") * 250 + photo.payload)
    assert largest_frame(padded) == (512, 512)
    np.testing.assert_array_equal(decoded(padded), decoded(photo.file))


@functools.cache
def quadrants() -> list[Still]:
    """The photo's four 256 x 256 quarters, each its own AVIF."""
    pixels = photos.astronaut()
    return [still(Image.fromarray(pixels[y:y + 256, x:x + 256]), quality=60) for y in (0, 256) for x in (0, 256)]


def grid(output: tuple[int, int], tiles: list[Item], rows: int = 2, columns: int = 2, wide: bool = False,
         extra_refs: tuple = (), extra_items: tuple = ()) -> bytes:
    """A grid image (its ImageGrid in idat) of these tiles as its dimg references, the primary item."""
    fields = struct.pack(">II" if wide else ">HH", *output)
    layout = Item(1, b"grid", bytes([0, wide, rows - 1, columns - 1]) + fields, (ispe(*output),), idat=True)
    return avif([layout, *tiles, *extra_items], refs=((b"dimg", 1, tuple(t.id for t in tiles)), *extra_refs))


def test_a_grid_is_sized_by_its_grid_and_its_tiles_by_their_frames():
    """libavif decodes a 2 x 2 grid of the photo's quarters as the photo; its size is the grid's. A grid that says
    more, a tile that decodes more, or a tile count that does not match the grid's are caught."""
    tiles = [quarter.item(2 + i) for i, quarter in enumerate(quadrants())]
    data = grid((512, 512), tiles)
    assert largest_frame(data) == (512, 512)
    assert np.abs(decoded(data).astype(int) - photos.astronaut()).mean() < 6  # (each quarter coded on its own)
    assert largest_frame(grid((9000, 9000), tiles, wide=True)) == (9000, 9000)
    assert largest_frame(grid((512, 512), [*tiles[:3], bomb().item(5)])) == (12000, 12000)
    with pytest.raises(ValueError, match="2 x 2 with 3 tiles"):
        largest_frame(grid((512, 512), tiles[:3]))
    with pytest.raises(ValueError, match="no AV1"):
        largest_frame(grid((512, 512), [*tiles[:3], Item(5, b"hvc1", tiles[3].data)]))


def test_only_what_libavif_decodes_is_read_the_alpha_among_it():
    """An item of an auxl reference to the image (or to one of a grid's tiles) is read as its alpha, which libavif
    decodes; an item no reference ties to the image, or a thumbnail's, is never read. libavif takes the first alpha
    whose auxC says so, and so all are read: up to 4 an image."""
    photo, bomb_ = astronaut(), bomb()
    alpha = bomb_.item(2, properties=(*bomb_.properties, full_box(b"auxC", 0, ALPHA_URN)))
    with_alpha = avif([photo.item(1), alpha], refs=((b"auxl", 2, (1,)),))
    assert Image.open(io.BytesIO(with_alpha)).mode == "RGBA"  # libavif takes it for the image's alpha
    assert largest_frame(with_alpha) == (12000, 12000)
    assert largest_frame(avif([photo.item(1), alpha], refs=((b"thmb", 2, (1,)),))) == (512, 512)
    assert largest_frame(avif([photo.item(1), bomb_.item(2)])) == (512, 512)
    tiles = [quarter.item(2 + i) for i, quarter in enumerate(quadrants())]
    tile_alpha = grid((512, 512), tiles, extra_items=(dataclasses.replace(alpha, id=6),),
                      extra_refs=((b"auxl", 6, (3,)),))
    assert largest_frame(tile_alpha) == (12000, 12000)
    crowd = [dataclasses.replace(alpha, id=id) for id in range(2, 7)]  # more than 4 an image: no image is made so
    with pytest.raises(ValueError, match="5 auxiliary images of 1"):
        largest_frame(avif([photo.item(1), *crowd], refs=tuple((b"auxl", item.id, (1,)) for item in crowd)))


def test_every_obu_of_an_item_is_walked_as_dav1d_parses_them():
    """dav1d decodes every frame of an item's data, and a later sequence header replaces the one before: a 12000 x
    12000 frame after the photo's, or a 64 x 64 sequence header then the bomb's, are the bomb's size."""
    photo, bomb_ = astronaut(), bomb()
    assert largest_frame(only_item(photo.payload + bomb_.payload)) == (12000, 12000)
    assert largest_frame(only_item(reduced_sequence(64, 64) + bomb_.payload)) == (12000, 12000)
    assert largest_frame(only_item(reduced_sequence(12000, 12000) + photo.payload)) == (512, 512)
    with pytest.raises(ValueError, match="before any sequence header"):
        largest_frame(only_item(frame_header(False) + photo.payload))
    with pytest.raises(ValueError, match="no AV1 frame"):
        largest_frame(only_item(reduced_sequence(64, 64)))


@functools.cache
def large_still() -> bytes:
    """7000 x 5000, 35 MP, its AV1 sequence header a full one (libaom's force-video-mode): 1 KB."""
    buf = io.BytesIO()
    Image.new("RGB", (7000, 5000), (90, 120, 150)).save(buf, "AVIF", quality=10, speed=10,
                                                         advanced={"force-video-mode": "1"})
    return buf.getvalue()


def test_a_large_still_with_a_full_sequence_header_is_within_a_pixel_limit_it_is_within():
    """Its frames are its sequence header's maximum, 7000 x 5000, not 2^13 a side (67 MP): within 50 MP, over 30."""
    data = large_still()
    payload = data[data.index(b"mdat") + 4:]
    sequence_at = next(i for i in range(0, 8, 2) if payload[i] >> 3 & 15 == SEQUENCE)
    assert not payload[sequence_at + 2] & 0x08  # reduced_still_picture_header = 0
    assert largest_frame(data) == (7000, 5000)
    assert decode_size(data, 50_000_000) == (7000, 5000)
    with pytest.raises(TooLarge):
        decode_size(data, 30_000_000)


@pytest.mark.parametrize("advanced", [{}, {"error-resilient": "1"}])
def test_full_sequence_headers_libaom_writes_are_their_size(advanced):
    """libaom's full headers of a still (force-video-mode), with frame ids where its frames are error resilient:
    libavif decodes the photo, and its frames are the photo's size."""
    photo = still(Image.fromarray(photos.astronaut()[:200, :300]), quality=60,
                  advanced={"force-video-mode": "1", **advanced})
    assert largest_frame(photo.file) == (300, 200)
    assert decoded(photo.file).shape == (200, 300, 3)


@pytest.mark.parametrize("options", [
    {},
    {"timing": True},
    {"timing": True, "equal_interval": True},
    {"timing": True, "decoder_model": True},
    {"timing": True, "equal_interval": True, "decoder_model": True},
    {"frame_ids": True},
    {"choose_tools": False},
    {"timing": True, "decoder_model": True, "frame_ids": True, "choose_tools": False},
])
def test_a_full_sequence_header_sizes_its_frames_by_their_override_flag(options):
    """A frame that does not override its size is the sequence header's maximum; one that does, or a switch frame,
    up to 2^bits a side (16 here); a frame shown again allocates nothing. Each header field before the flag moves
    it, so each is set here in turn."""
    presentation = options.get("decoder_model", False) and not options.get("equal_interval", False)
    frame = functools.partial(frame_header, presentation=presentation, frame_ids=options.get("frame_ids", False),
                              choose_tools=options.get("choose_tools", True))
    sequence = full_sequence(640, 480, **options)
    assert largest_frame(only_item(sequence + frame(False))) == (640, 480)
    assert largest_frame(only_item(sequence + frame(True, kind=FRAME))) == (65536, 65536)
    assert largest_frame(only_item(sequence + frame(False, shown=False) + frame(True, INTER))) == (65536, 65536)
    assert largest_frame(only_item(sequence + frame(False, SWITCH))) == (65536, 65536)
    assert largest_frame(only_item(sequence + obu(FRAME_HEADER, bits((1, 1), (0, 3))) + frame(False))) == (640, 480)


def test_files_libavif_would_not_read_are_value_errors():
    """A primary item that is not there or of another type, iloc's construction method 2, an extent outside the file
    or a grid whose ImageGrid libavif does not read are ValueErrors, the error a file that cannot be sized gets."""
    photo = astronaut()
    with pytest.raises(ValueError, match="no AV1 image"):
        largest_frame(avif([photo.item(1)], primary=7))
    with pytest.raises(ValueError, match="no AV1 image"):
        largest_frame(avif([Item(1, b"hvc1", photo.payload)]))
    outside = avif([photo.item(1, extents=((0, 10**6),))])
    with pytest.raises(ValueError, match="outside the file"):
        largest_frame(outside)
    method_2 = bytearray(avif([photo.item(1)]))
    at = method_2.index(b"iloc") + 4 + 4 + 2 + 2 + 2  # version and flags, sizes, item count, item id
    method_2[at + 1] = 2
    with pytest.raises(ValueError, match="construction method 2"):
        largest_frame(bytes(method_2))
    tiles = [quarter.item(2 + i) for i, quarter in enumerate(quadrants())]
    short = avif([Item(1, b"grid", bytes([0, 0, 1, 1, 2, 0, 2]), idat=True), *tiles],
                 refs=((b"dimg", 1, (2, 3, 4, 5)),))
    with pytest.raises(ValueError, match="grid item libavif does not read"):
        largest_frame(short)
