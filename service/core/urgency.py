"""A request's deadline and priority, set once where it arrives and read where it waits.

The deadline: when its client stops waiting for the answer. It is set once where the request arrives
(`timeout_ms` on the REST routes, the Open Inference Protocol's `timeout` parameter in microseconds as Triton reads
it, a gRPC call's own deadline) and read where the request would wait or work: before its decode, between its
files, before its batch, and as the bound on its wait in the queue. A request past it is dropped there, its images
never run, and answered 504 `deadline_exceeded` (gRPC DEADLINE_EXCEEDED).

The priority, Triton's: level 1 is taken into a batch first, then 2, up to VITSERVE_PRIORITY_LEVELS, the default
(a request's `priority` 0 or none). So that no level starves, an image that has waited VITSERVE_PRIORITY_AGING_MS
is taken as a level-1 one: under a flood of first-level requests, the others wait that long and one batch more.

Context variables, as the request's task and nothing else carries them: every request runs in a task of its own.
"""
import time
from contextvars import ContextVar

from .errors import BadInput, DeadlineExceeded

TIMEOUT_MS = ("the client's deadline in ms from the request's arrival: a request still unanswered then is dropped "
              "before its decode or its batch, its images never run, and answered 504 deadline_exceeded")

TIMEOUT_US_MAX = 2**64 - 1  # the Open Inference Protocol's `timeout`: a uint64 of µs, as Triton reads it

PRIORITY = ("Triton's priority: 1 is taken into a batch first, then 2, up to VITSERVE_PRIORITY_LEVELS, the default "
            "(0 or none); an image that has waited VITSERVE_PRIORITY_AGING_MS is taken as a level-1 one")

_DEADLINE: ContextVar[float | None] = ContextVar("deadline", default=None)  # time.perf_counter() seconds
_PRIORITY: ContextVar[int] = ContextVar("priority", default=0)  # 0: the default level


def from_query(start: float, timeout_ms: int | None, priority: int | None, levels: int) -> None:
    """The urgency of a REST route's request, its query's `timeout_ms` and `priority` (checked by their pydantic
    fields)."""
    set_urgency(start, timeout_ms and timeout_ms / 1e3, priority, levels)


def from_parameters(start: float, parameters: dict, levels: int, call_s: float | None = None) -> None:
    """The urgency of an Open Inference request, over REST or gRPC: its `timeout` (µs, Triton's) and `priority`
    parameters, whatever their types (a bool is no whole number here, though Python's isinstance takes it for one:
    BadInput naming them), and a gRPC call's own deadline (`call_s` left), the sooner."""
    timeout_us, priority = parameters.get("timeout"), parameters.get("priority")
    if timeout_us is not None and (type(timeout_us) is not int or not 1 <= timeout_us <= TIMEOUT_US_MAX):
        raise BadInput(f"parameter timeout {timeout_us!r}: a whole number of microseconds, 1 to {TIMEOUT_US_MAX}")
    if priority is not None and type(priority) is not int:
        raise BadInput(f"parameter priority {priority!r}: a whole number", "bad_priority")
    limits = [s for s in (call_s, timeout_us and timeout_us / 1e6) if s is not None]
    set_urgency(start, min(limits, default=None), priority, levels)


def set_urgency(start: float, timeout_s: float | None, priority: int | None, levels: int) -> None:
    """This request's deadline, `timeout_s` after `start` (time.perf_counter()) or none, and its priority level
    (1 first; 0 or None: the default, `levels`); BadInput beyond the levels."""
    _DEADLINE.set(None if timeout_s is None else start + timeout_s)
    if priority is not None and not 0 <= priority <= levels:
        raise BadInput(f"priority {priority}: 1 (first) to {levels} (VITSERVE_PRIORITY_LEVELS), or 0 for the "
                       "default", "bad_priority")
    _PRIORITY.set(priority if priority is not None and priority < levels else 0)  # the last level is the default


def request_priority() -> int:
    """This request's priority level; 0 for the default (the last)."""
    return _PRIORITY.get()


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
