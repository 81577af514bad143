"""A request's deadline: when its client stops waiting for the answer. It is set once where the request arrives
(`timeout_ms` on the REST routes, the Open Inference Protocol's `timeout` parameter in microseconds as Triton reads
it, a gRPC call's own deadline) and read where the request would wait or work: before its decode, before its
batch, and as the bound on its wait in the queue. A request past it is dropped there, its images never run, and
answered 504 `deadline_exceeded` (gRPC DEADLINE_EXCEEDED).

A context variable, as the request's task and nothing else carries it: every request runs in a task of its own.
"""
import time
from contextvars import ContextVar

from .errors import DeadlineExceeded

TIMEOUT_MS = ("the client's deadline in ms from the request's arrival: a request still unanswered then is dropped "
              "before its decode or its batch, its images never run, and answered 504 deadline_exceeded")

_DEADLINE: ContextVar[float | None] = ContextVar("deadline", default=None)  # time.perf_counter() seconds


def set_deadline(start: float, timeout_s: float | None) -> None:
    """This request's deadline: `timeout_s` after `start` (time.perf_counter()), or none."""
    _DEADLINE.set(None if timeout_s is None else start + timeout_s)


def request_deadline() -> float | None:
    """This request's deadline (time.perf_counter() seconds), or None: read on the event loop, in its task, and
    handed to the threads that work for it (an executor does not carry the context)."""
    return _DEADLINE.get()


def check_deadline(deadline: float | None, model: str, where: str) -> None:
    """DeadlineExceeded where the deadline has passed."""
    if deadline is not None and time.perf_counter() >= deadline:
        raise expired(model, where)


def expired(model: str, where: str) -> DeadlineExceeded:
    return DeadlineExceeded(f"the request's deadline passed {where} on {model}: its images were not run")
