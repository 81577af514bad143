"""What can go wrong in serving, as the service's own exceptions, free of the web stack.

The HTTP edge (`http/error_responses.py`) maps each kind to its status; the process backend carries them between
processes by kind name (`to_wire` / `from_wire`).
"""


class ServiceError(Exception):
    code = "internal_error"

    def __init__(self, message: str, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.message, self.code, self.retry_after_s = message, code or type(self).code, retry_after_s


class BadInput(ServiceError):
    code = "bad_request"


class NotFound(ServiceError):
    code = "not_found"


class TooLarge(ServiceError):
    code = "too_large"


class UnsupportedMedia(ServiceError):
    code = "unsupported_media_type"


class Forbidden(ServiceError):
    """Not allowed by this server's settings."""
    code = "forbidden"


class Unauthenticated(ServiceError):
    """No API key, or the wrong one (VITSERVE_API_KEY; core/api_key.py)."""
    code = "unauthorized"


class Unavailable(ServiceError):
    """Not now: loading, overloaded, or failed; retry_after_s says when to try again, where it makes sense."""
    code = "unavailable"


class DeadlineExceeded(ServiceError):
    """The request's own deadline (service/core/urgency.py) passed before it was answered."""
    code = "deadline_exceeded"


KINDS = {cls.__name__: cls for cls in (ServiceError, BadInput, NotFound, TooLarge, UnsupportedMedia, Forbidden,
                                       Unauthenticated, Unavailable, DeadlineExceeded)}


def overloaded(message: str, retry_after_s: int) -> Unavailable:
    return Unavailable(message, "overloaded", retry_after_s)


def to_wire(error: ServiceError) -> dict:
    return {"kind": type(error).__name__, "message": error.message, "code": error.code,
            "retry_after_s": error.retry_after_s}


def from_wire(error: dict) -> ServiceError:
    return KINDS.get(error["kind"], ServiceError)(error["message"], error["code"], error["retry_after_s"])
