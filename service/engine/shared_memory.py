"""Triton's system shared-memory extension: a client on this host registers a region of a file in /dev/shm (what
`shm_open` makes; tritonclient.utils.shared_memory, perf_analyzer --shared-memory system) under a name, then sends
requests whose tensors name a region, an offset and a byte size instead of carrying the bytes. An input is read
from the region straight into its batch by the process that runs the batches (the inference process under the
process backend: the HTTP worker never touches the tensor), and outputs asked for in shared memory are written
there once the request's batch is done.

The regions are the backend's (Regions, in the process that runs the batches). A region is refused when its key
names no regular file right in /dev/shm (no other folder, no symbolic link: the server would read and write
wherever it points), the file is too small for its offset and size, its name is taken, or it is unregistered while
a request uses it. A client can have the server map any file of /dev/shm that the server's user may read and write:
so by default only clients on this host may register, list or unregister regions, or name one in a request
(VITSERVE_SHARED_MEMORY=local: `local_client`; any: every client; false: none), and the API key guards them as it
guards /infer.
"""
import ipaddress
import mmap
import os
import stat
from collections.abc import Iterable
from dataclasses import astuple, dataclass, field
from pathlib import Path

import numpy as np

from service.core.errors import BadInput

SHM = Path("/dev/shm")
NO_CUDA_SHARED_MEMORY = ("CUDA shared memory is not offered by this server: send tensors in the body or in system "
                         "shared memory (/v2/systemsharedmemory)")


def local_client(host: str | None) -> bool:
    """Whether a client is on this host: its address loopback (127.0.0.0/8, ::1, ::ffff:127.x), or it has none
    (None: a Unix-socket peer, the one kind uvicorn and gRPC give no address for)."""
    if host is None:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # not an IP address: nothing says it is local
        return False
    # an IPv4 client of a dual-stack socket comes as ::ffff:127.0.0.1, which Python 3.11 calls no loopback
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def no_cuda_region(name: str) -> BadInput:
    return BadInput(f"no CUDA shared-memory region named {name!r} is registered")


@dataclass(frozen=True)
class Slice:
    """Some bytes of a registered region: a tensor a request keeps there."""
    region: str
    offset: int
    byte_size: int

    def rows(self, first: int, count: int, row_bytes: int) -> "Slice":
        """The slice of rows first..first+count-1 of a tensor whose rows take `row_bytes` each."""
        return Slice(self.region, self.offset + first * row_bytes, count * row_bytes)


@dataclass(frozen=True)
class SharedTensor:
    """A request's input kept in shared memory: where, and its shape (batch first)."""
    place: Slice
    shape: tuple[int, ...]

    def __len__(self) -> int:
        return self.shape[0]


def requested_slice(parameters: dict, what: str) -> Slice | None:
    """The shared memory a tensor's parameters name (Triton's shared_memory_region, shared_memory_byte_size and
    shared_memory_offset), or None where they name none."""
    region = parameters.get("shared_memory_region")
    if region is None:
        return None
    size, offset = parameters.get("shared_memory_byte_size"), parameters.get("shared_memory_offset", 0)
    if not (isinstance(region, str) and _whole(size) and _whole(offset)):
        raise BadInput(f"{what}: shared_memory_region needs a shared_memory_byte_size (and takes a "
                       "shared_memory_offset), whole numbers of at least 0")
    return Slice(region, offset, size)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class SharedIO:
    """Where one run's tensors lie in shared memory: its input (None: in its records) and the outputs asked for
    there, each the run's rows of it."""
    input: Slice | None = None
    outputs: dict[str, Slice] = field(default_factory=dict)

    def to_wire(self) -> list:
        """As JSON for the inference process: [input, {output: slice}], each slice [region, offset, byte_size]."""
        return [None if self.input is None else astuple(self.input),
                {name: astuple(s) for name, s in self.outputs.items()}]

    @classmethod
    def from_wire(cls, message: list) -> "SharedIO":
        place, outputs = message
        return cls(None if place is None else Slice(*place), {name: Slice(*s) for name, s in outputs.items()})


@dataclass(eq=False)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    memory: mmap.mmap  # the file up to the region's end; closed once no view of it is left
    users: int = 0  # requests under way that read or write it

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def view(self, part: Slice, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The slice as an array of `shape`, in place: BadInput where it passes the region's end."""
        if part.offset < 0 or part.offset + part.byte_size > self.byte_size:
            raise BadInput(f"shared memory of region {self.name!r} from offset {part.offset} for {part.byte_size} "
                           f"bytes: the region holds {self.byte_size}")
        count = int(np.prod(shape))
        return np.frombuffer(self.memory, dtype, count, self.offset + part.offset).reshape(shape)


class Claim:
    """One run's use of its regions: its input's rows (views into the region) and the views its outputs go to.
    The regions count it as a user until `release`."""

    def __init__(self, regions: list[Region], inputs: list[np.ndarray] | None, outputs: dict[str, np.ndarray]):
        self.regions, self.inputs, self.outputs = regions, inputs, outputs
        for region in regions:
            region.users += 1

    def write(self, records: np.ndarray) -> None:
        """The run's outputs, from its records into the shared memory asked for."""
        for name, view in self.outputs.items():
            view[:] = records[name]

    def release(self) -> None:
        for region in self.regions:
            region.users -= 1
        self.regions, self.inputs, self.outputs = [], None, {}


class Regions:
    """The registered regions, by name."""

    def __init__(self, root: Path = SHM):
        self.root = root
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise BadInput("a shared-memory region needs a name")
        if name in self._regions:
            raise BadInput(f"a shared-memory region named {name!r} is already registered; unregister it first")
        if offset < 0 or byte_size <= 0:
            raise BadInput(f"shared-memory region {name!r}: offset {offset} and byte_size {byte_size} must be at "
                           "least 0 and 1")
        memory = self._map(key, offset + byte_size)
        self._regions[name] = Region(name, key, offset, byte_size, memory)

    def _map(self, key: str, size: int) -> mmap.mmap:
        """The first `size` bytes of the file `key` names in /dev/shm, mapped for reading and writing."""
        file = key.removeprefix("/")
        if not file or "/" in file or file in (".", ".."):
            raise BadInput(f"shared-memory key {key!r} names no file in {self.root}: a key is one name, as "
                           "shm_open takes it (/NAME)")
        try:
            fd = os.open(self.root / file, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:  # absent, not ours to open, or a symbolic link (ELOOP)
            raise BadInput(f"shared-memory key {key!r}: {self.root / file} cannot be opened for reading and "
                           f"writing ({e.strerror}; symbolic links are not followed)") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BadInput(f"shared-memory key {key!r}: {self.root / file} is not a regular file")
            if info.st_size < size:
                raise BadInput(f"shared-memory key {key!r}: {self.root / file} holds {info.st_size} bytes, too few "
                               f"for the region's offset and byte_size ({size})")
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def unregister(self, name: str | None) -> None:
        """The region (every region where `name` is empty) forgotten; a name not registered is nothing to do, as
        in Triton. BadInput while a request uses it: what it reads or writes is still there."""
        names = [name] if name else list(self._regions)
        if busy := [n for n in names if n in self._regions and self._regions[n].users]:
            raise BadInput(f"shared-memory region {busy[0]!r} is in use by {self._regions[busy[0]].users} request(s) "
                           "under way; unregister it once they are answered")
        for n in names:
            self._regions.pop(n, None)  # its mapping closes with the last view of it

    def status(self, name: str | None = None) -> list[dict]:
        if name and name not in self._regions:
            raise BadInput(f"no shared-memory region named {name!r} is registered")
        return [r.status() for n, r in sorted(self._regions.items()) if not name or n == name]

    def _region(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise BadInput(f"no shared-memory region named {name!r} is registered")
        return region

    def claim(self, io: SharedIO, records: np.ndarray, input_field: str) -> Claim:
        """The views one run reads its input from (one per row) and writes its outputs to, checked against the
        regions and the records' layout: BadInput where a slice passes its region's end or its size is not the
        tensor's."""
        n, used = len(records), []
        inputs = None
        if io.input is not None:
            field_type = records.dtype[input_field]
            region = self._region(io.input.region)
            want = n * field_type.itemsize
            if io.input.byte_size != want:
                raise BadInput(f"input in shared memory of {io.input.byte_size} bytes; {n} rows of "
                               f"{field_type.base} {list(field_type.shape)} take {want}")
            inputs = list(region.view(io.input, field_type.base, (n, *field_type.shape)))
            used.append(region)
        outputs = {}
        for name, part in io.outputs.items():
            field_type = records.dtype[name]
            region = self._region(part.region)
            if part.byte_size < n * field_type.itemsize:
                raise BadInput(f"output {name!r} in shared memory: {part.byte_size} bytes, too few for "
                               f"{n * field_type.itemsize}")
            outputs[name] = region.view(Slice(part.region, part.offset, n * field_type.itemsize), field_type.base,
                                        (n, *field_type.shape))
            used.append(region)
        return Claim(_distinct(used), inputs, outputs)


def _distinct(regions: Iterable[Region]) -> list[Region]:
    return list({id(r): r for r in regions}.values())
