"""The per-thread CPU census of the GPU check (bench/census.py) on the service as it runs here: every thread of the
process backend read by its process's role and its own job, as the service names them (service/thread_names.py),
and the service at rest."""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from service_process import ROOT, photo_bytes, service_and_process

sys.path.insert(0, str(ROOT / "bench"))
import census  # noqa: E402

from service.thread_names import name_thread, named, thread_name  # noqa: E402


def test_a_thread_is_named_for_its_job_and_what_a_library_starts_in_a_block_takes_the_blocks_name():
    def job() -> tuple[str, str]:
        name_thread("decode-3")
        with named("ort"):
            inside = thread_name()
            started = ThreadPoolExecutor(1).submit(thread_name).result()  # a thread started within: named so
        return inside, started, thread_name()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(job).result() == ("ort", "ort", "decode-3")


def test_the_census_reads_every_thread_of_the_service_by_role_and_job():
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    with service_and_process(backend="process", workers=2, model_control="none") as (url, proc):
        at_rest = census.snapshot([proc.pid])
        time.sleep(3)
        rested = census.snapshot([proc.pid])
        before = census.snapshot([proc.pid])
        with httpx.Client(timeout=30) as client, ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: client.post(f"{url}/classify", files={"file": ("a.jpg", jpeg)}),
                                    range(80)))
        after = census.snapshot([proc.pid])
    assert all(a.status_code == 200 for a in answers)
    work = census.spent(before, after)
    kinds = {(t.role, t.kind) for t in work.values()}
    assert {("vitserve-http", "event loop"), ("vitserve-http", "decode-N"), ("vitserve-infer", "event loop"),
            ("vitserve-infer", "infer-N"), ("vitserve-infer", "ort")} <= kinds, sorted(kinds)
    assert sum(1 for t in work.values() if t.role == "vitserve-http" and t.main) == 2  # one event loop a worker
    # the workers' decode threads share the cores out: with eight a worker, 15 workers made 120 on a 16-core host
    decoders = [t for t in after.threads.values() if t.role == "vitserve-http" and t.kind == "decode-N"]
    assert 2 <= len(decoders) <= max(2, os.cpu_count()), len(decoders)
    busy = {t.kind: t.user + t.system for t in work.values() if t.role == "vitserve-infer"}
    assert busy["infer-N"] > 0  # the batches ran there
    lines = census.report(before, after, images=40)
    assert lines[0].startswith("census over") and "steal" in lines[0] and "context switches/s" in lines[0]
    ranked = lines[lines.index(next(line for line in lines if line.startswith("busiest threads"))) + 1:]
    cores = [float(line.split()[-6]) for line in ranked]
    assert cores == sorted(cores, reverse=True) and cores[0] > 0
    # at rest, the whole service (supervisor, inference process, workers) burns under 2% of a core
    idle = census.spent(at_rest, rested)
    assert sum(t.user + t.system for t in idle.values()) / census.TICKS / (rested.at - at_rest.at) < 0.02
