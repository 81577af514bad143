"""Run the process backend: one inference process and N HTTP worker processes on one port.

The supervisor makes a private runtime folder (in /dev/shm where it can: the workers' arenas, the inference
process's socket and heartbeat, prometheus-client's multiprocess files), starts the inference process, binds the
port (one listening socket per worker on Linux, which spreads connections over them; elsewhere one that all share)
and starts the workers. A worker that dies is replaced. So is the inference process, in place, after a backoff:
when it dies (an out-of-memory kill, a segfault in a provider), when it exits because its device failed every
batch (a CUDA error that poisons its context: engine/backends/device_health.py), and when its heartbeat says it has
made no progress for VITSERVE_INFERENCE_KILL_AFTER_S (a wedged kernel, a deadlock), when it is killed first. The
workers stay up meanwhile, answer 503 (`inference_restarting`) and join the new one. The crash number
VITSERVE_INFERENCE_MAX_CRASHES within VITSERVE_INFERENCE_CRASH_WINDOW_S stops the service instead, with exit status
1: a fault that keeps coming back is for the orchestrator (or a person) to see. SIGTERM or Ctrl-C drains: the
workers stop accepting and finish every request they accepted, then the inference process, which by then has
nothing queued, stops.
"""
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import uvicorn
from prometheus_client import multiprocess
from prometheus_client import values as prometheus_values

from service.core.metrics import Metrics
from service.core.settings import Settings
from service.core.thread_names import name_thread
from service.engine.backends import inference_process
from service.engine.backends.device_health import BROKEN_EXIT_STATUS
from service.engine.backends.heartbeat import HEARTBEAT, Heartbeat
from service.engine.backends.process import ProcessBackend
from service.http.app import create_app
from service.http.server import server_options

log = logging.getLogger("vitserve")


ROLES = ("vitserve-infer", "vitserve-http")  # what `ps`, `top` and /proc/PID/comm call the two kinds of process


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
    name_thread(ROLES[0])
    inference_process.main(settings, socket_path, log_level)


def worker_main(settings: Settings, sock: socket.socket, socket_path: Path, log_level: str) -> None:
    """One HTTP worker (multiprocessing, spawn): the whole app over a ProcessBackend."""
    name_thread(ROLES[1])
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s worker %(process)d: %(message)s")
    app = create_app(settings, ProcessBackend(settings, socket_path), grpc_shared_port=True)
    config = uvicorn.Config(app, **server_options(settings, log_level))
    uvicorn.Server(config).run(sockets=[sock])


def worker_count(settings: Settings) -> int:
    """The setting, or one per core with one left for the inference process (at least two)."""
    return settings.workers or max(2, (os.cpu_count() or 2) - 1)


def worker_decode_threads(settings: Settings, workers: int) -> int:
    """The setting, or the cores shared out over the workers (at least one each). Eight a worker, the thread
    backend's default, made 120 decode threads on 16 cores: each image's decode cost 1.44 ms of CPU there against
    0.93 ms on an idle thread, and one a worker served /classify 1.08-1.09x faster (bench/results, 2026-11-27)."""
    return settings.decode_threads or max(1, (os.cpu_count() or 1) // workers)


class Crashes:
    """The inference process's crashes within the window, and how long to wait before the next start."""

    def __init__(self, most: int, window_s: float):
        self.most, self.window_s, self.times = most, window_s, deque()

    def crashed(self, now: float) -> bool:
        """Count one; False where that makes the most the window allows: stop."""
        self.times.append(now)
        while self.times[0] < now - self.window_s:
            self.times.popleft()
        return len(self.times) < self.most

    def backoff_s(self) -> float:
        """1 s after a first crash, then doubling, to 30 s: a fault that recurs at once is not retried in a loop."""
        return min(30.0, 2.0 ** (len(self.times) - 1))


def serve(settings: Settings, log_level: str = "info") -> int:
    """Run until SIGTERM/SIGINT; the exit status (1 if the inference process kept failing)."""
    count = worker_count(settings)
    settings = settings.model_copy(update={"decode_threads": worker_decode_threads(settings, count)})
    socks = listeners(settings.host, settings.port, count)
    if settings.grpc_port:  # so does the gRPC port, which the workers then share (SO_REUSEPORT)
        bind(settings.host, settings.grpc_port).close()
    folder = runtime_folder()
    (folder / "metrics").mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder / "metrics")  # inherited by every process started below
    # prometheus-client chose where values go when this process imported it, before the folder was set
    prometheus_values.ValueClass = prometheus_values.get_value_class()
    restarts = Metrics().inference_restarts
    socket_path = folder / "inference.sock"
    heartbeat = Heartbeat(folder / HEARTBEAT)
    context = multiprocessing.get_context("spawn")
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start_inference() -> multiprocessing.Process:
        heartbeat.reset()  # silent until its first beat: starting up is no hang
        process = context.Process(target=inference_main, args=(settings, socket_path, log_level),
                                  name="vitserve-inference")
        process.start()
        return process

    def start_worker(i: int) -> multiprocessing.Process:
        """Worker i on socket i, which the supervisor holds open: connections the kernel gives it while its worker
        is replaced wait in its queue for the next one."""
        worker = context.Process(target=worker_main, args=(settings, socks[i % len(socks)], socket_path, log_level),
                                 name="vitserve-worker")
        worker.start()
        return worker

    inference = start_inference()
    workers = [start_worker(i) for i in range(count)]
    log.info("vitserve on http://%s:%d: %d HTTP workers, one inference process", settings.host, settings.port,
             len(workers))
    crashes = Crashes(settings.inference_max_crashes, settings.inference_crash_window_s)
    status, restart_at = 0, None
    try:
        while not stopping:
            time.sleep(0.2)
            if restart_at is None and not inference.is_alive():
                multiprocess.mark_process_dead(inference.pid)
                exited = f"exited with {inference.exitcode}" + (
                    " (its device failed every batch)" if inference.exitcode == BROKEN_EXIT_STATUS else "")
                if not crashes.crashed(time.monotonic()):
                    log.error("the inference process %s, its crash number %d within %gs; stopping", exited,
                              crashes.most, crashes.window_s)
                    status = 1
                    break
                log.error("the inference process %s; starting another in %gs", exited, crashes.backoff_s())
                restart_at = time.monotonic() + crashes.backoff_s()
            elif restart_at is not None and time.monotonic() >= restart_at:
                inference, restart_at = start_inference(), None
                restarts.inc()
            elif restart_at is None and (silence := heartbeat.silence()) is not None \
                    and silence > settings.inference_kill_after_s:
                log.error("the inference process has made no progress for %.0fs; killing it", silence)
                inference.kill()  # (SIGKILL reaches a stopped process too) the next turn counts it and restarts
                inference.join()
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
