"""Run the service: `python -m service [--host H] [--port P]` (other settings: VITSERVE_* variables)."""
import argparse
import logging

import uvicorn

from .app import create_app
from .repository import RepositoryError
from .settings import Settings


def main(argv: list[str] | None = None) -> None:
    settings = Settings()
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    parser.add_argument("--host", default=settings.host)
    parser.add_argument("--port", type=int, default=settings.port)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings.model_copy(update={"host": args.host, "port": args.port}))
    except RepositoryError as e:
        raise SystemExit(f"error: {e}") from None
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
