"""The API key (VITSERVE_API_KEY), checked alike by the HTTP middleware and the gRPC service."""
import hmac

from .errors import Unauthenticated


def check_key(given: bytes, key: bytes, where: str) -> None:
    """Unauthenticated unless `given` is the key, compared in constant time; `where`: how the client sends it."""
    if not hmac.compare_digest(given, key):
        raise Unauthenticated("wrong API key" if given else f"this server needs an API key: send it in {where}")
