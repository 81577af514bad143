"""Run the process backend: one inference process and N HTTP worker processes on one port.

The supervisor makes a private runtime folder (in /dev/shm where it can: the workers' arenas, the inference
process's socket, prometheus-client's multiprocess files), starts the inference process, binds the port (one
listening socket per worker on Linux, which spreads connections over them; elsewhere one that all share) and
starts the workers. A worker that dies is replaced. SIGTERM or Ctrl-C drains: the workers stop accepting and
finish every request they accepted, then the inference process, which by then has nothing queued, stops.
"""
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import uvicorn
from prometheus_client import multiprocess

from .app import create_app
from .backends import server
from .backends.process import ProcessBackend
from .http_server import server_options
from .settings import Settings

log = logging.getLogger("vitserve")


ROLES = ("vitserve-infer", "vitserve-http")  # what `ps`, `top` and /proc/PID/comm call the two kinds of process


def name_process(name: str) -> None:
    """The process's name as `ps` and /proc/PID/comm show it (Linux; elsewhere it keeps its own)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


def runtime_folder() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="vitserve-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def listeners(host: str, port: int, workers: int) -> list[socket.socket]:
    """One listening socket per HTTP worker on the one port, where Linux spreads new connections over them evenly
    (SO_REUSEPORT); elsewhere one socket that all share. On a shared socket whichever worker wakes first accepts
    every connection waiting, and a kept-alive connection stays where it landed: 256 connections went 0 to 33 a
    worker over 15 workers, so a few event loops could bind while others idle."""
    bind(host, port).close()  # a port in use fails here, before any process starts, even where it is ours
    if sys.platform != "linux":
        return [bind(host, port)]
    return [bind(host, port, reuse_port=True) for _ in range(workers)]


def inference_main(settings: Settings, socket_path: Path, log_level: str) -> None:
    """The inference process (multiprocessing, spawn)."""
    name_process(ROLES[0])
    server.main(settings, socket_path, log_level)


def worker_main(settings: Settings, sock: socket.socket, socket_path: Path, log_level: str) -> None:
    """One HTTP worker (multiprocessing, spawn): the whole app over a ProcessBackend."""
    name_process(ROLES[1])
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s worker %(process)d: %(message)s")
    app = create_app(settings, ProcessBackend(settings, socket_path), grpc_shared_port=True)
    config = uvicorn.Config(app, **server_options(settings, log_level))
    uvicorn.Server(config).run(sockets=[sock])


def worker_count(settings: Settings) -> int:
    """The setting, or one per core with one left for the inference process (at least two)."""
    return settings.workers or max(2, (os.cpu_count() or 2) - 1)


def serve(settings: Settings, log_level: str = "info") -> int:
    """Run until SIGTERM/SIGINT; the exit status (1 if the inference process failed)."""
    count = worker_count(settings)
    socks = listeners(settings.host, settings.port, count)
    if settings.grpc_port:  # so does the gRPC port, which the workers then share (SO_REUSEPORT)
        bind(settings.host, settings.grpc_port).close()
    folder = runtime_folder()
    (folder / "metrics").mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder / "metrics")  # inherited by every process started below
    socket_path = folder / "inference.sock"
    context = multiprocessing.get_context("spawn")
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    inference = context.Process(target=inference_main, args=(settings, socket_path, log_level),
                                name="vitserve-inference")
    inference.start()

    def start_worker(i: int) -> multiprocessing.Process:
        """Worker i on socket i, which the supervisor holds open: connections the kernel gives it while its worker
        is replaced wait in its queue for the next one."""
        worker = context.Process(target=worker_main, args=(settings, socks[i % len(socks)], socket_path, log_level),
                                 name="vitserve-worker")
        worker.start()
        return worker

    workers = [start_worker(i) for i in range(count)]
    log.info("vitserve on http://%s:%d: %d HTTP workers, one inference process", settings.host, settings.port,
             len(workers))
    status = 0
    try:
        while not stopping:
            time.sleep(0.2)
            if not inference.is_alive():
                log.error("the inference process exited with %s; stopping", inference.exitcode)
                status = 1
                break
            for i, worker in enumerate(workers):
                if not worker.is_alive():
                    log.error("HTTP worker %d exited with %s; starting another", worker.pid, worker.exitcode)
                    multiprocess.mark_process_dead(worker.pid)
                    workers[i] = start_worker(i)
    finally:
        for sock in socks:  # with the workers' copies closing too, new connections are refused at once
            sock.close()
        for worker in workers:  # drain: uvicorn finishes the requests it accepted
            worker.terminate()
        for worker in workers:
            worker.join()
        inference.terminate()
        inference.join()
        shutil.rmtree(folder, ignore_errors=True)
    return status
