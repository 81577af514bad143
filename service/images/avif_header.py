"""The largest frame an AVIF's AV1 data makes its decoder allocate, read from the file before anything is decoded.

An AVIF declares its size in its `ispe` boxes, which Pillow reports and the pixel limit checks; libavif then hands
the AV1 data to dav1d, which allocates the frame size the data's own sequence header says, and crops to `ispe` only
afterwards. A 2 KB file declaring 64 x 64 made dav1d allocate a 12000 x 12000 frame, 670 MB of the server's memory
(issue 65). This walks the file's boxes (ISO/IEC 14496-12 and 23008-12) to the AV1 data libavif decodes: every
`av01` item (the image, its alpha, a grid's tiles) and the first sample of every `av01` track (an image sequence's
first frame), and reads each sequence header there (AV1 spec 5.5), and the output size of every `grid` item.

A sequence header bounds every frame after it: a reduced still-picture header at its maximum size exactly (what
still AVIFs carry), any other at the largest size its frame headers can code, 2^bits a side (dav1d reads a frame's
size in that many bits, without comparing it with the maximum). Anything this cannot follow raises ValueError: a file
whose decoded size cannot be known is not decoded.
"""
import struct
from collections.abc import Iterator

_SEQUENCE_HEADER = 1  # obu_type


def largest_frame(data: bytes) -> tuple[int, int]:
    """(width, height) of the largest frame that decoding the AVIF may allocate: the most pixels of any sequence
    header or grid it holds. ValueError where the file is malformed or holds no AV1 data."""
    payloads, grids = [], []
    for kind, start, end in _boxes(data, 0, len(data)):
        if kind == b"meta":
            items, sizes = _items(data, start, end)
            payloads, grids = payloads + items, grids + sizes
        elif kind == b"moov":
            payloads += _first_samples(data, start, end)
    if not payloads:
        raise ValueError("no AV1 image in the file")
    frames = [size for payload in payloads for size in _sequence_sizes(payload)]
    if not frames:
        raise ValueError("no AV1 sequence header in the image's data")
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
    if size not in (0, 4, 8) or at + size > end:
        raise ValueError("a field size iloc does not allow")
    return int.from_bytes(data[at:at + size], "big")


def _items(data: bytes, start: int, end: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    """The meta box's `av01` items' data, and its `grid` items' output sizes (every entry of every iinf and iloc
    box: a file that names an item twice is read both ways)."""
    kinds: dict[int, set[bytes]] = {}
    located, idat = [], (0, 0)
    for kind, body, stop in _boxes(data, start + 4, end):  # (meta is a full box)
        if kind == b"iinf":
            for item, item_type in _item_types(data, body, stop):
                kinds.setdefault(item, set()).add(item_type)
        elif kind == b"iloc":
            located += _locations(data, body, stop)
        elif kind == b"idat":
            idat = body, stop
    av1, grids = [], []
    for item, method, extents in located:
        types = kinds.get(item, set())
        if b"av01" in types:
            av1.append(_extents(data, idat, method, extents))
        if b"grid" in types:
            grids.append(_grid_size(_extents(data, idat, method, extents)))
    return av1, grids


def _item_types(data: bytes, start: int, end: int) -> list[tuple[int, bytes]]:
    """(item id, item type) of the iinf box's infe entries (versions 2 and 3; the older carry no type)."""
    version, = _unpack(">B", data, start, end)
    types = []
    for kind, at, stop in _boxes(data, start + (6 if version == 0 else 8), end):
        if kind == b"infe" and _unpack(">B", data, at, stop)[0] >= 2:
            wide = data[at] >= 3
            item, = _unpack(">I" if wide else ">H", data, at + 4, stop)
            types.append((item, _unpack(">4s", data, at + 4 + (4 if wide else 2) + 2, stop)[0]))
    return types


def _locations(data: bytes, start: int, end: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(item id, construction method, [(offset, length), ...]) of each iloc entry, base offsets added."""
    version, sizes, more = _unpack(">B3xBB", data, start, end)
    offset_size, length_size, base_size = sizes >> 4, sizes & 15, more >> 4
    index_size = more & 15 if version in (1, 2) else 0
    id_form = ">I" if version == 2 else ">H"
    count, = _unpack(id_form, data, start + 6, end)
    at, located = start + 6 + struct.calcsize(id_form), []
    for _ in range(count):
        item, = _unpack(id_form, data, at, end)
        at += struct.calcsize(id_form)
        method = 0
        if version in (1, 2):
            method = _unpack(">H", data, at, end)[0] & 15
            at += 2
        base = _uint(data, at + 2, base_size, end)  # after data_reference_index
        extent_count, = _unpack(">H", data, at + 2 + base_size, end)
        at += 4 + base_size
        step = index_size + offset_size + length_size
        if extent_count * max(step, 1) > end - at:  # (every extent takes a byte at least: no loop over nothing)
            raise ValueError("iloc lists more extents than it holds")
        extents = []
        for _ in range(extent_count):
            offset = _uint(data, at + index_size, offset_size, end)
            extents.append((base + offset, _uint(data, at + index_size + offset_size, length_size, end)))
            at += step
        located.append((item, method, extents))
    return located


def _extents(data: bytes, idat: tuple[int, int], method: int, extents: list[tuple[int, int]]) -> bytes:
    """An item's data: its extents of the file (construction method 0) or of the idat box (1), joined."""
    if method not in (0, 1):
        raise ValueError(f"item data by construction method {method}")
    first, last = (0, len(data)) if method == 0 else idat
    spans = [(first + offset, last if length == 0 else first + offset + length) for offset, length in extents]
    if any(not first <= start <= stop <= last for start, stop in spans):
        raise ValueError("an item's extent lies outside the file")
    if sum(stop - start for start, stop in spans) > last - first:
        raise ValueError("an item's extents are larger than the file")
    return b"".join(data[start:stop] for start, stop in spans)


def _grid_size(payload: bytes) -> tuple[int, int]:
    """A grid item's output (width, height) (ImageGrid, ISO/IEC 23008-12 6.6.2.3)."""
    flags = _unpack(">BB", payload, 0, len(payload))[1]
    return _unpack(">II" if flags & 1 else ">HH", payload, 4, len(payload))


def _first_samples(data: bytes, start: int, end: int) -> list[bytes]:
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


def _first_sample(data: bytes, stbl: tuple[int, int]) -> bytes | None:
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
    return data[offset:offset + size]


def _sequence_sizes(payload: bytes) -> list[tuple[int, int]]:
    """The largest frame (width, height) of each sequence header among the payload's OBUs."""
    sizes, at = [], 0
    while at < len(payload):
        header = payload[at]
        kind, extension, has_size = (header >> 3) & 15, header & 4, header & 2
        at += 2 if extension else 1
        if has_size:
            length, at = _leb128(payload, at)
        else:
            length = len(payload) - at
        if at + length > len(payload):
            raise ValueError("an AV1 OBU is cut short")
        if kind == _SEQUENCE_HEADER:
            sizes.append(_sequence_frame(payload[at:at + length]))
        at += length
    return sizes


def _leb128(payload: bytes, at: int) -> tuple[int, int]:
    value = 0
    for i in range(8):
        if at + i >= len(payload):
            break
        value |= (payload[at + i] & 0x7F) << (7 * i)
        if not payload[at + i] & 0x80:
            return value, at + i + 1
    raise ValueError("an AV1 OBU size is cut short")


class _Bits:
    def __init__(self, data: bytes):
        self.value, self.left = int.from_bytes(data, "big"), 8 * len(data)

    def read(self, n: int) -> int:
        if n > self.left:
            raise ValueError("an AV1 sequence header is cut short")
        self.left -= n
        return (self.value >> self.left) & ((1 << n) - 1)

    def uvlc(self) -> None:
        zeros = 0
        while not self.read(1):
            zeros += 1
            if zeros >= 32:
                raise ValueError("an AV1 sequence header's uvlc is too long")
        self.read(zeros)


def _sequence_frame(header: bytes) -> tuple[int, int]:
    """The largest frame a sequence header's frames may have (AV1 spec 5.5.1, as dav1d's parse_seq_hdr reads it)."""
    bits = _Bits(header)
    bits.read(4)  # seq_profile, still_picture
    reduced = bits.read(1)
    if reduced:
        bits.read(5)  # seq_level_idx
    else:
        decoder_model, delay_bits = 0, 0
        if bits.read(1):  # timing_info_present_flag
            bits.read(64)  # num_units_in_display_tick, time_scale
            if bits.read(1):  # equal_picture_interval
                bits.uvlc()
            decoder_model = bits.read(1)
            if decoder_model:
                delay_bits = bits.read(5) + 1
                bits.read(32 + 10)  # num_units_in_decoding_tick, two lengths
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
    width, height = bits.read(width_bits) + 1, bits.read(height_bits) + 1
    return (width, height) if reduced else (1 << width_bits, 1 << height_bits)
