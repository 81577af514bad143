"""The largest frame an AVIF's AV1 data makes its decoder allocate, read from the file before anything is decoded.

An AVIF declares its size in its `ispe` boxes, which Pillow reports and the pixel limit checks; libavif then hands
the AV1 data to dav1d, which allocates the frame size the data's own headers say, and crops to `ispe` only
afterwards. A 2 KB file declaring 64 x 64 made dav1d allocate a 12000 x 12000 frame, 670 MB of the server's memory
(issue 65). This walks the file's boxes (ISO/IEC 14496-12 and 23008-12) to the AV1 data libavif decodes (libavif
1.4's read.c): the `meta` box's primary item, a grid's tiles (its `dimg` references) and the grid's output size, the
alpha (`auxl` items of the image or of its tiles), and the first sample of every `av01` track (an image sequence's
first frame); and there every OBU (AV1 spec 5.3), as dav1d parses all of an item's data: a sequence header that a
later one replaces bounds nothing.

Nothing of the file is copied but the few bytes a header takes, and no other item is looked at (issue 73: 1,000
other items located to the end of a 2 MB file cost 1.9 GB when each was copied). Every loop steps forward through
the file, the images walked are bounded (a grid's 256 x 256 tiles, 4 auxiliary images an image) and so are their
OBUs (4 an image and 256 more): time and memory follow the upload's size.

A frame is as large as its sequence header's maximum (`max_frame_width_minus_1` + 1, ...) unless its frame header
overrides the size (`frame_size_override_flag`); then up to 2^bits a side, the size dav1d reads in that many bits
without comparing it with the maximum. Anything this cannot follow raises ValueError: a file whose decoded size
cannot be known is not decoded.
"""
import struct
from collections.abc import Iterator
from functools import lru_cache
from typing import NamedTuple

_SEQUENCE_HEADER, _FRAME_HEADERS = 1, {3, 6, 7}  # obu_type: frame header, frame, redundant frame header
_KEY_FRAME, _SWITCH_FRAME, _SELECT = 0, 3, 2
_SEQUENCE_BYTES = 512  # past every field a sequence header has before its colour config (about 3,100 bits at most)
_FRAME_BYTES = 16  # past a frame header's frame_size_override_flag (67 bits at most)
# an image's data holds a sequence header and a frame, sometimes metadata or tile groups: a flood of OBUs is no image
_OBUS_PER_IMAGE, _OBU_ALLOWANCE = 4, 256
_AUXILIARIES_PER_IMAGE = 4  # an alpha, a depth map...: libavif decodes one, and a crowd of them is no image either
_MOST_TILES = 2 * 256 * 256  # of one image's grids: two at their largest (ImageGrid's rows and columns: 8 bits)


def largest_frame(data: bytes) -> tuple[int, int]:
    """(width, height) of the largest frame that decoding the AVIF may allocate: the most pixels of any frame its
    AV1 data codes or grid it holds. ValueError where the file is malformed or holds no AV1 image."""
    meta, moov = _top_level(data)
    images, grids = _item_images(data, *meta) if meta else ([], [])
    if moov:
        images += _first_samples(data, *moov)
    if not images:
        raise ValueError("no AV1 image in the file")
    frames = _frames(data, images)
    if not frames:
        raise ValueError("no AV1 frame in the image's data")
    return max([*frames, *grids], key=lambda size: size[0] * size[1])


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, body start, box end) of each box from start to end."""
    while start < end:
        if end - start < 8:
            raise ValueError("a box is cut short")
        size, kind = struct.unpack_from(">I4s", data, start)
        body = start + 8
        if size == 1:
            (size,), body = _unpack(">Q", data, body, end), body + 8
        elif size == 0:
            size = end - start
        if size < body - start or start + size > end:
            raise ValueError(f"box {kind!r} of {size} bytes does not fit its place")
        yield kind, body, start + size
        start += size


def _unpack(form: str, data: bytes, at: int, end: int) -> tuple:
    if at + struct.calcsize(form) > end:
        raise ValueError("a box is cut short")
    return struct.unpack_from(form, data, at)


def _uint(data: bytes, at: int, size: int, end: int) -> int:
    """An unsigned big-endian field of 0, 4 or 8 bytes (iloc's)."""
    if at + size > end:
        raise ValueError("a box is cut short")
    return int.from_bytes(data[at:at + size], "big")


def _top_level(data: bytes) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The bodies of the first meta and moov boxes (libavif reads no other)."""
    found: dict[bytes, tuple[int, int]] = {}
    for kind, body, end in _boxes(data, 0, len(data)):
        if kind in (b"meta", b"moov"):
            found.setdefault(kind, (body, end))
            if len(found) == 2:
                break
    return found.get(b"meta"), found.get(b"moov")


class _Meta(NamedTuple):
    data: bytes
    boxes: dict[bytes, tuple[int, int]]  # the body of the first box of each type in the meta box


class _Item(NamedTuple):
    """An item's data as its iloc entry locates it: `count` extents from `at` in the iloc box, their offsets from
    `base` and within `limit`, `size` bytes in all. The extents are read where the data is walked, never listed."""
    at: int
    count: int
    fields: tuple[int, int, int]  # index, offset and length sizes
    base: int
    limit: int
    size: int

    def spans(self, data: bytes) -> Iterator[tuple[int, int]]:
        index_size, offset_size, length_size = self.fields
        if not length_size:  # every extent 0 bytes long, as libavif reads them
            return
        step, offset_at = sum(self.fields), self.at + index_size
        for at in range(offset_at, offset_at + self.count * step, step):
            start = self.base + int.from_bytes(data[at:at + offset_size], "big")
            length = int.from_bytes(data[at + offset_size:at + offset_size + length_size], "big")
            if start + length > self.limit:
                raise ValueError("an item's extent lies outside the file")
            if length:
                yield start, start + length


_NOWHERE = _Item(0, 0, (0, 0, 0), 0, 0, 0)


class _Sample(NamedTuple):
    """A track's sample: `size` bytes from `start`."""
    start: int
    size: int

    def spans(self, data: bytes) -> Iterator[tuple[int, int]]:
        yield self.start, self.start + self.size


def _item_images(data: bytes, start: int, end: int) -> tuple[list[_Item], list[tuple[int, int]]]:
    """The data of the av01 items libavif decodes for the primary image and its alpha, and the output size of each
    grid among them. An item of an auxl reference to the image (or to a tile) is taken for its alpha: libavif takes
    the first whose auxC says alpha, and so a superset is walked."""
    meta = _Meta(data, {})
    for kind, body, stop in _boxes(data, start + 4, end):  # (meta is a full box)
        meta.boxes.setdefault(kind, (body, stop))
    primary = _primary(meta)
    colour, grids = _resolve(meta, [primary])
    if not colour:
        raise ValueError("no AV1 image in the file")
    alpha, alpha_grids = _resolve(meta, _auxiliaries(meta, {primary, *colour}))
    grids += alpha_grids
    items = list(dict.fromkeys(colour + alpha))
    located = _locations(meta, {*items, *(grid for grid, _ in grids)})
    images = [located.get(item, _NOWHERE) for item in items]
    return images, [_grid_size(data, located.get(grid, _NOWHERE), tiles) for grid, tiles in grids]


def _box(meta: _Meta, kind: bytes) -> tuple[int, int]:
    return meta.boxes.get(kind, (0, 0))


def _primary(meta: _Meta) -> int:
    if b"pitm" not in meta.boxes:
        raise ValueError("no primary item")
    start, end = meta.boxes[b"pitm"]
    return _unpack(">xxxxH" if _unpack(">B", meta.data, start, end)[0] == 0 else ">xxxxI", meta.data, start, end)[0]


def _resolve(meta: _Meta, items: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The av01 items libavif decodes for these items, in order (an av01 item itself, a grid its tiles), and each grid
    with its number of tiles. Items of other types are skipped, as libavif skips them."""
    types = _types(meta, set(items))
    grids = [item for item in items if types.get(item) == b"grid"]
    tiles = _tiles(meta, set(grids))
    if any(kind != b"av01" for kind in _types(meta, {t for grid in tiles.values() for t in grid}).values()):
        raise ValueError("a grid tile that is no AV1 image")
    av1 = [item for item in items if types.get(item) == b"av01"]
    return av1 + [tile for grid in grids for tile in tiles.get(grid, ())], [(g, len(tiles.get(g, ()))) for g in grids]


def _types(meta: _Meta, items: set[int]) -> dict[int, bytes]:
    """The item type of each of these items the iinf box names (infe versions 2 and 3; the older carry no type)."""
    start, end = _box(meta, b"iinf")
    if not items or start == end:
        return {}
    data, types = meta.data, {}
    for kind, at, stop in _boxes(data, start + (6 if data[start] == 0 else 8), end):
        if kind == b"infe" and _unpack(">B", data, at, stop)[0] >= 2:
            wide = data[at] >= 3
            item, = _unpack(">I" if wide else ">H", data, at + 4, stop)
            if item in items:
                types.setdefault(item, _unpack(">4s", data, at + (10 if wide else 8), stop)[0])
    return types


def _references(meta: _Meta, kind: bytes) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(from item, to items) of each of the iref box's references of this type (versions 0 and 1; libavif skips any
    other)."""
    start, end = _box(meta, b"iref")
    if start == end or meta.data[start] > 1:
        return
    form = ">I" if meta.data[start] else ">H"
    width = struct.calcsize(form)
    for found, at, stop in _boxes(meta.data, start + 4, end):
        if found == kind:
            source, = _unpack(form, meta.data, at, stop)
            count, = _unpack(">H", meta.data, at + width, stop)
            yield source, _unpack(f">{count}{form[1]}", meta.data, at + width + 2, stop)


def _tiles(meta: _Meta, grids: set[int]) -> dict[int, tuple[int, ...]]:
    """Each of these grids' tiles, in order (its dimg reference)."""
    tiles: dict[int, tuple[int, ...]] = {}
    count = 0
    for source, targets in _references(meta, b"dimg") if grids else ():
        if source in grids:
            if source in tiles:
                raise ValueError("a grid with two lists of tiles")
            tiles[source], count = targets, count + len(targets)
            if count > _MOST_TILES:
                raise ValueError("more grid tiles than grids have")
    return tiles


def _auxiliaries(meta: _Meta, images: set[int]) -> list[int]:
    """The items of an auxl reference to any of these images."""
    found = list(dict.fromkeys(source for source, targets in _references(meta, b"auxl") if images & set(targets)))
    if len(found) > _AUXILIARIES_PER_IMAGE * len(images):
        raise ValueError(f"{len(found)} auxiliary images of {len(images)} images")
    return found


def _locations(meta: _Meta, items: set[int]) -> dict[int, _Item]:
    """Where each of these items' data lies (iloc versions 0 to 2; construction methods 0, the file, and 1, the idat
    box), within the file and no larger than it. An item without a location has no data: libavif skips it."""
    if b"iloc" not in meta.boxes:
        return {}
    data, (start, end) = meta.data, meta.boxes[b"iloc"]
    version, sizes, more = _unpack(">B3xBB", data, start, end)
    fields = (more & 15 if version in (1, 2) else 0, sizes >> 4, sizes & 15)  # index, offset, length sizes
    base_size = more >> 4
    if version > 2 or not {base_size, *fields} <= {0, 4, 8}:
        raise ValueError("an iloc box libavif does not read")
    id_form = ">I" if version == 2 else ">H"
    count, = _unpack(id_form, data, start + 6, end)
    at, located = start + 6 + struct.calcsize(id_form), {}
    for _ in range(count):
        item, = _unpack(id_form, data, at, end)
        at += struct.calcsize(id_form)
        method = 0
        if version:
            method = _unpack(">H", data, at, end)[0] & 15
            at += 2
        base = _uint(data, at + 2, base_size, end)  # after data_reference_index
        extents, = _unpack(">H", data, at + 2 + base_size, end)
        at += 4 + base_size
        if extents * sum(fields) > end - at:
            raise ValueError("iloc lists more extents than it holds")
        if item in items:
            if item in located:
                raise ValueError(f"item {item} located twice")
            located[item] = _located(meta, method, _Item(at, extents, fields, base, 0, 0))
        at += extents * sum(fields)
    return located


def _located(meta: _Meta, method: int, entry: _Item) -> _Item:
    """The entry with its source (the file or the idat box) and its size, its extents checked."""
    if method not in (0, 1) or (method == 1 and b"idat" not in meta.boxes):
        raise ValueError(f"item data by construction method {method}")
    first, last = _box(meta, b"idat") if method else (0, len(meta.data))
    item = entry._replace(base=first + entry.base, limit=last)
    size = sum(end - start for start, end in item.spans(meta.data))
    if size > last - first:
        raise ValueError("an item's extents are larger than the file")
    return item._replace(size=size)


def _grid_size(data: bytes, grid: _Item, tiles: int) -> tuple[int, int]:
    """A grid item's output (width, height) (ImageGrid, ISO/IEC 23008-12 6.6.2.3), its tiles counted as libavif
    counts them."""
    payload = _Reader(data, grid).take(grid.size, 12)
    version, flags, rows, columns = _unpack(">BBBB", payload, 0, len(payload))
    if version != 0 or grid.size != (12 if flags & 1 else 8):
        raise ValueError("a grid item libavif does not read")
    if (rows + 1) * (columns + 1) != tiles:
        raise ValueError(f"a grid of {rows + 1} x {columns + 1} with {tiles} tiles")
    return _unpack(">II" if flags & 1 else ">HH", payload, 4, len(payload))


def _first_samples(data: bytes, start: int, end: int) -> list[_Sample]:
    """The first sample of every av01 track of the moov box."""
    samples = []
    for kind, body, stop in _boxes(data, start, end):
        stbl = _find(data, body, stop, (b"mdia", b"minf", b"stbl")) if kind == b"trak" else None
        if stbl is not None and _is_av1(data, stbl) and (sample := _first_sample(data, stbl)) is not None:
            samples.append(sample)
    return samples


def _find(data: bytes, start: int, end: int, path: tuple[bytes, ...]) -> tuple[int, int] | None:
    """The body (start, end) of the box at `path` under start..end, or None."""
    for kind, body, stop in _boxes(data, start, end):
        if kind == path[0]:
            return (body, stop) if len(path) == 1 else _find(data, body, stop, path[1:])
    return None


def _is_av1(data: bytes, stbl: tuple[int, int]) -> bool:
    stsd = _find(data, *stbl, (b"stsd",))
    return stsd is not None and any(kind == b"av01" for kind, _, _ in _boxes(data, stsd[0] + 8, stsd[1]))


def _first_sample(data: bytes, stbl: tuple[int, int]) -> _Sample | None:
    """A track's first sample (the first chunk's start, the first sample's size), None where it has none."""
    sizes, chunks = _find(data, *stbl, (b"stsz",)), _find(data, *stbl, (b"stco",))
    wide = chunks is None
    if wide:
        chunks = _find(data, *stbl, (b"co64",))
    if sizes is None or chunks is None:
        raise ValueError("a track without sample sizes or chunk offsets")
    size, count = _unpack(">II", data, sizes[0] + 4, sizes[1])
    if count == 0 or _unpack(">I", data, chunks[0] + 4, chunks[1])[0] == 0:
        return None
    if size == 0:
        size, = _unpack(">I", data, sizes[0] + 12, sizes[1])
    offset, = _unpack(">Q" if wide else ">I", data, chunks[0] + 8, chunks[1])
    if offset + size > len(data):
        raise ValueError("a track's sample lies outside the file")
    return _Sample(offset, size)


class _Reader:
    """Reads an image's data forward through its spans of the file, copying only what `read` and `take` return."""

    def __init__(self, data: bytes, image: _Item | _Sample):
        self.data, self.spans, self.left = data, image.spans(data), image.size
        self.at = self.end = 0

    def _advance(self, n: int, keep: bool) -> bytes:
        if n > self.left:
            raise ValueError("an AV1 OBU is cut short")
        self.left -= n
        if self.at + n <= self.end:  # within the span at hand: most reads
            self.at += n
            return self.data[self.at - n:self.at] if keep else b""
        parts = []
        while n:
            while self.at == self.end:
                self.at, self.end = next(self.spans)
            step = min(n, self.end - self.at)
            if keep:
                parts.append(self.data[self.at:self.at + step])
            self.at, n = self.at + step, n - step
        return b"".join(parts)

    def read(self, n: int) -> bytes:
        return self._advance(n, True)

    def skip(self, n: int) -> None:
        self._advance(n, False)

    def take(self, length: int, most: int) -> bytes:
        """The first `most` bytes of the next `length`, all of which are passed."""
        head = self.read(min(length, most))
        self.skip(length - len(head))
        return head


def _frames(data: bytes, images: list[_Item | _Sample]) -> list[tuple[int, int]]:
    """The size of every frame the images' OBUs code, walked one image after the other as one decoder would take them
    (libavif may hand a grid's tiles to one decoder: a sequence header holds across them)."""
    budget, sequence, frames = _OBU_ALLOWANCE + _OBUS_PER_IMAGE * len(images), None, set()
    for image in images:
        reader = _Reader(data, image)
        while reader.left:
            budget -= 1
            if budget < 0:
                raise ValueError("more AV1 OBUs than images carry")
            kind, length = _obu(reader)
            if kind == _SEQUENCE_HEADER:
                sequence = _sequence(reader.take(length, _SEQUENCE_BYTES))
            elif kind in _FRAME_HEADERS:
                if sequence is None:
                    raise ValueError("an AV1 frame before any sequence header")
                if (size := _frame_size(sequence, reader.take(length, _FRAME_BYTES))) is not None:
                    frames.add(size)
            else:
                reader.skip(length)
    return list(frames)


def _obu(reader: _Reader) -> tuple[int, int]:
    """The next OBU's type and payload length, its header passed (AV1 spec 5.3.1)."""
    header = reader.read(1)[0]
    if header & 4:
        reader.skip(1)  # obu_extension_header: temporal and spatial ids
    length = _leb128(reader) if header & 2 else reader.left
    if length > reader.left:
        raise ValueError("an AV1 OBU is cut short")
    return (header >> 3) & 15, length


def _leb128(reader: _Reader) -> int:
    value = 0
    for i in range(8):
        byte = reader.read(1)[0]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value
    raise ValueError("an AV1 OBU size is too long")


class _Bits:
    def __init__(self, data: bytes):
        self.value, self.left = int.from_bytes(data, "big"), 8 * len(data)

    def read(self, n: int) -> int:
        if n > self.left:
            raise ValueError("an AV1 header is cut short")
        self.left -= n
        return (self.value >> self.left) & ((1 << n) - 1)

    def uvlc(self) -> None:
        zeros = 0
        while not self.read(1):
            zeros += 1
            if zeros >= 32:
                raise ValueError("an AV1 sequence header's uvlc is too long")
        self.read(zeros)


class _Sequence(NamedTuple):
    """What of a sequence header sizes its frames and places their frame_size_override_flag."""
    reduced: bool  # reduced_still_picture_header: every frame a key frame of the largest size
    bits: tuple[int, int]  # frame_width_bits_minus_1 + 1, frame_height_bits_minus_1 + 1
    largest: tuple[int, int]  # max_frame_width_minus_1 + 1, max_frame_height_minus_1 + 1
    presentation_bits: int  # frame_presentation_time_length where frame headers carry a time, else 0
    frame_id_bits: int  # idLen where frame_id_numbers_present_flag, else 0
    screen_content_tools: int  # seq_force_screen_content_tools (_SELECT: each frame says)
    integer_mv: int  # seq_force_integer_mv (_SELECT: each frame says)


@lru_cache(maxsize=256)  # (a grid's tiles repeat one header)
def _sequence(header: bytes) -> _Sequence:
    """A sequence header OBU's fields up to its frame-level tool choices (AV1 spec 5.5, as dav1d's parse_seq_hdr reads
    them)."""
    bits = _Bits(header)
    bits.read(4)  # seq_profile, still_picture
    reduced = bits.read(1)
    presentation_bits = 0
    if reduced:
        bits.read(5)  # seq_level_idx
    else:
        decoder_model, delay_bits, equal_interval = 0, 0, 0
        if bits.read(1):  # timing_info_present_flag
            bits.read(64)  # num_units_in_display_tick, time_scale
            equal_interval = bits.read(1)
            if equal_interval:
                bits.uvlc()  # num_ticks_per_picture_minus_1
            decoder_model = bits.read(1)
            if decoder_model:
                delay_bits = bits.read(5) + 1
                bits.read(32 + 5)  # num_units_in_decoding_tick, buffer_removal_time_length_minus_1
                presentation_bits = (bits.read(5) + 1) * (not equal_interval)  # (frames carry no time then)
        display_model = bits.read(1)
        for _ in range(bits.read(5) + 1):  # operating points
            bits.read(12)  # operating_point_idc
            if bits.read(5) > 7:  # seq_level_idx
                bits.read(1)  # seq_tier
            if decoder_model and bits.read(1):
                bits.read(2 * delay_bits + 1)
            if display_model and bits.read(1):
                bits.read(4)
    width_bits, height_bits = bits.read(4) + 1, bits.read(4) + 1
    largest = bits.read(width_bits) + 1, bits.read(height_bits) + 1
    if reduced:
        return _Sequence(True, (width_bits, height_bits), largest, 0, 0, _SELECT, _SELECT)
    frame_id_bits = 0
    if bits.read(1):  # frame_id_numbers_present_flag
        delta = bits.read(4) + 2
        frame_id_bits = bits.read(3) + 1 + delta
    bits.read(7)  # use_128x128_superblock ... enable_dual_filter
    if bits.read(1):  # enable_order_hint
        bits.read(2)  # enable_jnt_comp, enable_ref_frame_mvs
    screen = _SELECT if bits.read(1) else bits.read(1)  # seq_choose_screen_content_tools
    integer_mv = (_SELECT if bits.read(1) else bits.read(1)) if screen else _SELECT
    return _Sequence(False, (width_bits, height_bits), largest, presentation_bits, frame_id_bits, screen, integer_mv)


@lru_cache(maxsize=256)
def _frame_size(sequence: _Sequence, header: bytes) -> tuple[int, int] | None:
    """The size of the frame a frame header makes dav1d allocate (AV1 spec 5.9.2, dav1d's parse_frame_hdr): the
    sequence's largest unless the header overrides it, then up to 2^bits a side; None for a frame shown again
    (show_existing_frame), which allocates nothing."""
    if sequence.reduced:
        return sequence.largest
    bits = _Bits(header)
    if bits.read(1):  # show_existing_frame
        return None
    frame_type, shown = bits.read(2), bits.read(1)
    bits.read(sequence.presentation_bits if shown else 1)  # frame_presentation_time or showable_frame
    if not (frame_type == _SWITCH_FRAME or (frame_type == _KEY_FRAME and shown)):
        bits.read(1)  # error_resilient_mode
    bits.read(1)  # disable_cdf_update
    screen = bits.read(1) if sequence.screen_content_tools == _SELECT else sequence.screen_content_tools
    if screen and sequence.integer_mv == _SELECT:
        bits.read(1)  # force_integer_mv
    bits.read(sequence.frame_id_bits)  # current_frame_id
    if frame_type == _SWITCH_FRAME or bits.read(1):  # frame_size_override_flag
        return 1 << sequence.bits[0], 1 << sequence.bits[1]
    return sequence.largest
