"""Freed memory back to the system: glibc keeps a process's freed heap for its reuse, in an arena per thread that
allocated, so that RSS stays at its peak after a burst (a reload's old session, a refused crowd of photos)."""
import ctypes
import gc
from contextlib import suppress


def release_memory() -> None:
    """What the process freed given back to the system (a no-op on a libc without malloc_trim)."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
