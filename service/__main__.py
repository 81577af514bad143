"""Run the service: `python -m service [--host H] [--port P] [--backend thread|process] [--workers N]`
(other settings: VITSERVE_* variables)."""
import argparse
import logging
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import uvicorn

from repository import RepositoryError, servable
from service.core.settings import Settings
from service.engine.backends.device_health import BROKEN_EXIT_STATUS
from service.engine.runtime import CUDA, choose_device
from service.http.server import server_options

log = logging.getLogger("vitserve")


def probe_device(settings: Settings) -> str:
    """The device the models would run on, found in a throwaway process, so that this one holds no GPU context."""
    entries, _ = servable(settings.model_repository)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as probe:
        return probe.submit(choose_device, entries, settings.providers).result()


def main(argv: list[str] | None = None) -> None:
    settings = Settings()
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    parser.add_argument("--host", default=settings.host)
    parser.add_argument("--port", type=int, default=settings.port)
    parser.add_argument("--backend", default=settings.backend, choices=["auto", "thread", "process"])
    parser.add_argument("--workers", type=int, default=settings.workers, help="HTTP workers of the process backend")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings.model_copy(update={"host": args.host, "port": args.port, "backend": args.backend,
                                           "workers": args.workers})
    try:
        backend = settings.backend
        if backend == "auto":
            backend = "process" if probe_device(settings) == CUDA else "thread"
            log.info("backend: %s", backend)
        if backend == "process":
            from service.supervisor import serve
            servable(settings.model_repository)  # a broken repository fails before any process starts
            sys.exit(serve(settings, args.log_level))
        from service.core.metrics import Metrics
        from service.engine.backends.local import LocalBackend
        from service.http.app import create_app
        # a device that fails every batch: the server drains (as on SIGTERM) and exits BROKEN_EXIT_STATUS, for
        # the orchestrator to start another process
        metrics = Metrics()
        backend = LocalBackend(settings, metrics, on_broken=lambda why: os.kill(os.getpid(), signal.SIGTERM))
        app = create_app(settings, backend, metrics=metrics)
    except RepositoryError as e:
        raise SystemExit(f"error: {e}") from None
    # uvicorn raises the SIGTERM it drained on again once done: a drain that finished is a clean exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0 if backend.health.broken is None else BROKEN_EXIT_STATUS))
    uvicorn.run(app, host=args.host, port=args.port, **server_options(settings, args.log_level))


if __name__ == "__main__":
    main()
