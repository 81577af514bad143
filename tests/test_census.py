"""The per-thread CPU census of the GPU check (bench/census.py) on the service as it runs here: every thread of the
process backend read by its process's role and its own job, as the service names them (service/core/thread_names.py),
and the service at rest."""
import http.client
import socket
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from service_process import ROOT, connections_to_every_worker, photo_bytes, service_and_process

sys.path.insert(0, str(ROOT / "bench"))
import census  # noqa: E402

from service.core.settings import Settings  # noqa: E402
from service.supervisor import worker_decode_threads  # noqa: E402
from service.core.thread_names import name_thread, named, thread_name  # noqa: E402


def test_a_thread_is_named_for_its_job_and_what_a_library_starts_in_a_block_takes_the_blocks_name():
    def job() -> tuple[str, str]:
        name_thread("decode-3")
        with named("ort"):
            inside = thread_name()
            started = ThreadPoolExecutor(1).submit(thread_name).result()  # a thread started within: named so
        return inside, started, thread_name()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(job).result() == ("ort", "ort", "decode-3")


def classify_on(client: socket.socket, jpeg: bytes, requests: int) -> list[int]:
    """`requests` /classify uploads one after another on an open connection (kept alive): their statuses."""
    connection = http.client.HTTPConnection("127.0.0.1", timeout=60)
    connection.sock = client  # this connection, to the worker that holds it
    body = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jpg\"\r\n\r\n" + jpeg
            + b"\r\n--b--\r\n")
    statuses = []
    for _ in range(requests):
        connection.request("POST", "/classify", body, {"Content-Type": "multipart/form-data; boundary=b"})
        response = connection.getresponse()
        response.read()
        statuses.append(response.status)
    return statuses


def test_the_census_reads_every_thread_of_the_service_by_role_and_job():
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    with service_and_process(backend="process", workers=2, model_control="none") as (url, proc):
        # two connections to each worker, whatever the kernel's hash does with new ones (a kept-alive client's few
        # connections may all land on one worker, and a worker's decode thread starts with its first decode)
        pinned = connections_to_every_worker(url, workers=2, each=2)
        try:
            before = census.snapshot([proc.pid])
            with ThreadPoolExecutor(4) as pool:  # 40 requests a worker, four at a time in all
                answers = list(pool.map(lambda client: classify_on(client, jpeg, 20),
                                        [c for held in pinned.values() for c in held]))
            after = census.snapshot([proc.pid])
        finally:
            for client in (c for held in pinned.values() for c in held):
                client.close()
        # at rest once every process has started and served: just after ready, a worker may still import and the
        # inference process still settle
        at_rest = census.snapshot([proc.pid])
        time.sleep(3)
        rested = census.snapshot([proc.pid])
    assert [status for statuses in answers for status in statuses] == [200] * 80
    work = census.spent(before, after)
    kinds = {(t.role, t.kind) for t in work.values()}
    assert {("vitserve-http", "event loop"), ("vitserve-http", "decode-N"), ("vitserve-infer", "event loop"),
            ("vitserve-infer", "infer-N"), ("vitserve-infer", "ort")} <= kinds, sorted(kinds)
    # each worker's event loop, found under its own pid (the census reads the supervisor's children), served its 40
    loops = {pid: t.user + t.system for (pid, _), t in work.items() if t.role == "vitserve-http" and t.main}
    assert set(loops) == set(pinned) and all(loops.values()), loops
    # each worker decoded in threads of its own, no more than its share of the cores: with eight a worker, 15
    # workers made 120 on a 16-core host
    share = worker_decode_threads(Settings(), len(pinned))
    decoders = Counter(pid for (pid, _), t in after.threads.items() if t.role == "vitserve-http"
                       and t.kind == "decode-N")
    assert set(decoders) == set(pinned) and all(1 <= n <= share for n in decoders.values()), (decoders, share)
    busy = Counter()
    for t in work.values():
        if t.role == "vitserve-infer":
            busy[t.kind] += t.user + t.system  # summed over the threads of a kind (a CUDA host runs two infer-N)
    assert busy["infer-N"] > 0  # the batches ran there
    lines = census.report(before, after, images=80)
    assert lines[0].startswith("census over") and "steal" in lines[0] and "context switches/s" in lines[0]
    ranked = lines[lines.index(next(line for line in lines if line.startswith("busiest threads"))) + 1:]
    cores = [float(line.split()[-6]) for line in ranked]
    assert cores == sorted(cores, reverse=True) and cores[0] > 0
    # at rest, the whole service (supervisor, inference process, workers) burns under a quarter of a core: a thread
    # that spins takes a whole one, where the four processes' event-loop timers came to 2-13% on this slow, noisy
    # host (7 to 39 ticks in 3 s; a 2% bound failed by chance)
    idle = census.spent(at_rest, rested)
    assert sum(t.user + t.system for t in idle.values()) / census.TICKS / (rested.at - at_rest.at) < 0.25, \
        sorted((t.user + t.system, t.role, t.name) for t in idle.values() if t.user + t.system)
