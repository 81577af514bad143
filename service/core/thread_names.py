"""Names for the service's threads as the OS sees them (/proc/PID/task/TID/comm, `top -H`, py-spy, perf), so that a
per-thread CPU census of a busy host reads by job: the event loop (the process's main thread: vitserve-http or
vitserve-infer), decode-N, infer-N, cuda-graph-N, v2-json, and ort (ONNX Runtime's own pools) or nvimgcodec. A
thread starts with its creator's name, so the threads a library starts are named by the block they start in."""
import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_PR_SET_NAME, _PR_GET_NAME = 15, 16


def _prctl(option: int, name: ctypes.Array) -> bool:
    try:
        return ctypes.CDLL(None).prctl(option, name, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: threads keep the names they have
        return False


def name_thread(name: str) -> None:
    """The calling thread's OS name (at most 15 bytes); a process's main thread names the process in `ps`."""
    _prctl(_PR_SET_NAME, ctypes.create_string_buffer(name.encode()[:15]))


def thread_name() -> str:
    buffer = ctypes.create_string_buffer(16)
    return buffer.value.decode() if _prctl(_PR_GET_NAME, buffer) else ""


def name_pool_thread() -> None:
    """A ThreadPoolExecutor initializer: the OS name of its Python name ("decode_3" -> "decode-3")."""
    name_thread(threading.current_thread().name.replace("_", "-"))


@contextmanager
def named(name: str) -> Iterator[None]:
    """The threads a library starts within the block are named `name` (they inherit it); the caller's name is put
    back after."""
    before = thread_name()
    name_thread(name)
    try:
        yield
    finally:
        if before:
            name_thread(before)
