"""One command for a GPU host (`make gpu-check`), in one device call of 470 s at most: its parts in order of
value, each in a process of its own with a time box (BOXES, 470 s together; --budget scales them), cut at its box
so that the next one runs. Every line goes at once to gpu-<date>-<commit>.txt in --out (the device's $OUT: a call
killed at any point returns what ran), and gpu-<date>-<commit>-summary.txt is rewritten after each part: alarms
first (a CUDA host serving on the CPU), then each part's outcome.

    python bench/gpu_stage.py pack                         # on the CPU host: the graphs and wheels, in parts
    python bench/gpu_check.py --out $OUT                    # on the GPU host: 470 s at most
    python bench/gpu_check.py --quick --budget 60 --expect-cuda   # a rehearsal on the CPU: every part, cut short
    python bench/gpu_check.py --parts service --switches "1 decode thread" --rounds 2   # one A/B again

tests:   pytest over tests/test_gpu.py and tests/test_gpu_decode.py, test by test over half the cores (pytest-xdist).
service: `python -m service` (the backend it picks: process on CUDA) serving DeiT-Ti from --cache, with its fp16
         sibling on CUDA (so in fp16); wrk (bench/wrk.py, one fixed request over kept-alive connections) for
         1 + N + 1 s a level, measured over the middle N s: images/s, p50/p99, errors (non-2xx among them), the
         GPU's utilisation (NVML), the host's busy cores (/proc/stat: wrk's included) and the CPU ms per image of the
         HTTP workers, the inference process, wrk and the whole host. /classify with 1 and 8 JPEGs (the 451 x 300
         chelsea photo) and with a 12 MP phone photo at each of --switches against the default, interleaved
         (schedule): by default GPU decoding through the decode router, every JPEG to the GPU, and every request
         traced (OTLP to a receiver here that counts the spans). On a CUDA host a model served on the CPU is an alarm.
graphs:  bench/gpu.py --parts graphs --models GRAPH_MODELS --batches 256: DeiT-Ti, then Swin-T (DeiT-Ti alone on
         the CPU), ORT fp16 against torch and torch.compile. It exports nothing on a host whose torch cannot: a
         missing graph stops it with the command that makes it.
decode:  bench/gpu.py --parts decode: the CPU path on every core against GpuDecoder and nvImageCodec alone, batches
         of 1, 16 and 64 from one and two threads, for the 451 x 300 photo, the 12 MP one and mixed sizes.
census:  the service at the default settings: /classify with 1 and 8 JPEGs and /v2 with 1 UINT8 image, each with a
         census (bench/census.py: every thread of the service and of wrk by role and job, the host's steal,
         softirq, context switches and interrupts).
profile: py-spy (--subprocesses) on the service through one level each of /classify 1 JPEG and /v2 8 images: each
         process's busy threads and its busiest leaf frames.
ops:     bench/op_profile.py: ONNX Runtime's profiler on Swin-T in fp16 at batch 256 (DeiT-Ti fp32 at batch 8 on the
         CPU), its kernels launched blocking: the nodes' time by op type, and the costliest nodes.
engines: bench/jpeg_engines.py: nvImageCodec's decode alone, configuration by configuration (issue 59's E0-E5);
         all of them take 2-3 minutes, so a full run is `--parts engines --budget 1400`.
relevance: bench/relevance.py --parts cost: a class-specific relevance map's cost against a forward pass, at batch 1
         and 16, for the embedded ViT, DeiT and Swin (docs/attention.md's CPU figures beside it).
The cache's graphs travel without their weights (bench/weightless.py), and get new random ones before any part runs.
Without CUDA the same parts run on the CPU (fp32, GPU decoding not run, test_gpu.py skipped), and the file says so;
--expect-cuda makes that an alarm, as a GPU that nvidia-smi sees does. The commit is git's, or GPU_CHECK_COMMIT's
where the tree has no git repository (a copy on the GPU host).
"""
import argparse
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cache, partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "tests", ROOT / "bench"):
    sys.path.insert(0, str(folder))
import census  # noqa: E402
import httpx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import wrk  # noqa: E402
from jpegs import phone_photo  # noqa: E402
from process_cost import INFERENCE, WORKERS, supervisor_pid  # noqa: E402
from service_overhead import decode_cpu_ms  # noqa: E402
from service_process import model_pixels, otlp_receiver, photo_bytes, running_service  # noqa: E402
from weightless import refill_all, strip_all  # noqa: E402

from repository import read_entry  # noqa: E402
from service.engine.runtime import CUDA, choose_device  # noqa: E402

MODEL = "deit_tiny_patch16_224"
# the graphs part on CUDA: the models of issue 40's targets (on the CPU, MODEL alone: batch 256 of ViT-B/16 takes
# a minute there)
GRAPH_MODELS = [MODEL, "swin_tiny_patch4_window7_224"]
# each part's time box in seconds, in the order they run (the most valuable first): 470 s in all, one device call
# that leaves a 15-minute lease room for the start, the staging and a rerun (docs/development.md#the-gpu-check)
# (2026-12-04 on an H200, of 110/120/60/30/40/30 s: the tests 108 s, service 105, graphs 54, decode 26, census 34,
# profile 27)
BOXES = {"tests": 140, "service": 140, "graphs": 60, "decode": 30, "census": 35, "profile": 25, "ops": 15,
         "engines": 15, "relevance": 10}
BUDGET = sum(BOXES.values())
RESULTS = ROOT / "bench" / "results"
ALARM = "ALARM: "  # a line a part prints for the summary's top


class PartFailed(RuntimeError):
    """A part's failure already told in the report: no traceback needed."""


class Report:
    """Each line printed and appended to the results file at once: a run cut short keeps what it measured."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        with self.path.open("a") as out:
            out.write(text + "\n")


def output(*argv: str) -> str:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def commit() -> str:
    """GPU_CHECK_COMMIT, else this tree's short commit, "-dirty" with changes to tracked files; "unknown" without
    git."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return output("git", "rev-parse", "--short", "HEAD") + ("-dirty" if output("git", "status", "--porcelain",
                                                                                    "-uno") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device() -> str:
    try:
        return output("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
    except (OSError, subprocess.SubprocessError) as e:
        return f"no GPU seen (nvidia-smi: {e})"


def cpus() -> str:
    """What the CPU figures are per: the CPUs' model, hardware threads per core, the CPUs this process may use, and
    a cgroup's CPU quota (a container's: /proc/stat's busy cores count the host's CPUs regardless)."""
    model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    try:  # "0", "0,64" or "0-1"
        ranges = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip().split(",")
        per_core = str(sum(int(r.split("-")[-1]) - int(r.split("-")[0]) + 1 for r in ranges))
    except (OSError, ValueError):
        per_core = "?"
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        limit = "no CPU quota" if quota == "max" else f"a CPU quota of {int(quota) / int(period):g}"
    except (OSError, ValueError):
        limit = "no cgroup v2 CPU quota seen"
    return (f"{os.cpu_count()} CPUs ({model[1] if model else 'model unknown'}; threads per core {per_core}; "
            f"{len(os.sched_getaffinity(0))} usable here; {limit})")


@cache
def nvml() -> object | None:
    """The first GPU's NVML handle, or None without NVML (pynvml, from nvidia-ml-py) or a GPU."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 - ImportError, or NVML's own errors: no utilisation then
        return None


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores so far, from /proc/stat (idle and iowait are not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


class Usage:
    """Over a `with` block: the GPU's utilisation (%, NVML sampled every 0.2 s: mean and max) and the host's busy
    cores."""

    def __enter__(self) -> "Usage":
        self.samples: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.start = busy_jiffies()
        if nvml() is not None:
            self.thread.start()
        return self

    def sample(self) -> None:
        import pynvml
        while not self.stop.wait(0.2):
            self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(nvml()).gpu)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if nvml() is not None:
            self.thread.join()
        (busy0, total0), (busy1, total1) = self.start, busy_jiffies()
        self.cores = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)

    @property
    def gpu(self) -> str:
        if not self.samples:
            return "n/a"
        return f"{sum(self.samples) / len(self.samples):.0f}/{max(self.samples)}"


def served(cache: Path, cuda: bool) -> tuple[list[Path], dict[str, wrk.Request]]:
    """The model's repository folders (its fp16 sibling on CUDA) and the requests the levels post."""
    from gpu import export
    folders = [export(cache, MODEL)] + ([export(cache, MODEL, "fp16")] if cuda else [])
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    pixels = model_pixels(folders[0], jpeg)
    images = read_entry(folders[0]).manifest["input"]["name"]
    query = f"model={MODEL}&top_k=1"
    requests = {f"/classify {n} JPEG": wrk.classify_request(jpeg, n, query=query) for n in (1, 8)}
    requests |= {f"/v2 UINT8 {n} img": wrk.v2_request(MODEL, images, pixels[None].repeat(n, 0)) for n in (1, 8)}
    requests["/classify 12 MP"] = wrk.classify_request(phone_photo(), 1, query=query)
    return folders, requests


# the A/B's switches, each against the default (issue 47): settings a service starts with
# (the default's decode threads: one per core, at most 8)
SWITCHES = {"default": {}, "CUDA blocking sync": {"cuda_blocking_sync": True}, "8 HTTP workers": {"workers": 8},
            "1 decode thread": {"decode_threads": 1}, "2 decode threads": {"decode_threads": 2},
            "GPU decoding": {"gpu_decode": True},  # the decode router: the CPU decodes what the GPU's queue can't take
            "GPU decoding, every JPEG": {"gpu_decode": True, "gpu_decode_queue_batches": 10**6},
            "max batch 64": {"max_batch_size": 64}, "traces": {}}  # traces: OTEL_* variables (traces_exported)
GPU_ONLY = ("GPU decoding", "GPU decoding, every JPEG", "CUDA blocking sync")  # not run without CUDA
SERVICE_SWITCHES = ["GPU decoding", "GPU decoding, every JPEG", "traces"]  # the service part's, by default
SERVICE_LEVELS = ["/classify 1 JPEG", "/classify 8 JPEG", "/classify 12 MP"]
CENSUS_LEVELS = ["/classify 1 JPEG", "/classify 8 JPEG", "/v2 UINT8 1 img"]  # with a census each, at the default


@contextmanager
def traces_exported(on: bool) -> Iterator[list[int] | None]:
    """With `on`, a service started inside traces every request (OpenTelemetry's defaults: every one sampled, the
    batch span processor's queue and delays) to an OTLP receiver here that counts what it gets, each export's
    count in the list: the traces' cost under load, spans dropped by a full queue included (issue 77)."""
    if not on:
        yield None
        return
    names = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT")
    saved = {name: os.environ.get(name) for name in names}
    with otlp_receiver(keep=False) as (endpoint, counts):
        os.environ.update(dict(zip(names, ("otlp", endpoint))))
        try:
            yield counts
        finally:
            for name, value in saved.items():
                os.environ.pop(name) if value is None else os.environ.update({name: value})


def schedule(switches: list[str], rounds: int = 1) -> list[str]:
    """The A/B's order: the default first, again after every three switches and at the end of each round, so that
    drift shows."""
    order = ["default"]
    for _ in range(rounds):
        for i, switch in enumerate(switches):
            order.append(switch)
            if i % 3 == 2 or i == len(switches) - 1:
                order.append("default")
    return order


@dataclass
class Level:
    figures: wrk.Figures
    gpu: str
    cores: float  # busy host cores
    per_image: dict[str, float]  # CPU ms per image by role, and "all" (the busy host cores')
    census: list[str]


def level(url: str, supervisor: int, request: wrk.Request, clients: int, seconds: int) -> Level:
    """wrk for 1 + `seconds` + 1 s; the window is the middle `seconds`: the host's and each thread's CPU, the GPU's
    utilisation, and wrk's images/s over its run."""
    run = threading.Thread(target=lambda: result.append(wrk.run(url, request, clients, seconds + 2, wrk_threads())))
    result: list[wrk.Figures] = []
    run.start()
    time.sleep(1)
    pids = [supervisor, os.getpid()]  # wrk is this process's child
    before = census.snapshot(pids)
    with Usage() as usage:
        time.sleep(seconds)
        after = census.snapshot(pids)
    run.join()
    if not result:
        raise RuntimeError("wrk failed (its error is above)")
    f = result[0]
    images = max(f.images_per_s * (after.at - before.at), 1)
    work = census.spent(before, after)
    per_image = {role: sum(t.user + t.system for t in work.values() if t.role == role) / census.TICKS / images * 1e3
                 for role in (WORKERS, INFERENCE, "wrk")}
    per_image["all"] = usage.cores * (after.at - before.at) / images * 1e3
    return Level(f, usage.gpu, usage.cores, per_image, census.report(before, after, images))


HEADER = (f"{'route':<18} {'conns':>5} {'img/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors (non-2xx)':>16} {'GPU %':>7} "
          f"{'cores':>5} {'HTTP ms':>7} {'infer ms':>8} {'wrk ms':>6} {'host ms':>7}")


def row(label: str, clients: int, m: Level) -> str:
    f = m.figures
    latency = f"{f.p50_ms:>8.1f} {f.p99_ms:>8.1f}" if f.images_per_s else f"{'-':>8} {'-':>8}"
    ms = m.per_image
    return (f"{label:<18} {clients:>5} {f.images_per_s:>9,.0f} {latency} {f'{f.errors} ({f.non_2xx})':>16} "
            f"{m.gpu:>7} {m.cores:>5.1f} {ms[WORKERS]:>7.3f} {ms[INFERENCE]:>8.3f} {ms['wrk']:>6.3f} {ms['all']:>7.3f}")


def cpu_served(models: list[dict]) -> list[str]:
    """The models of /models served on the CPU, save the int8 export's (a CPU-only plan): on a CUDA host each is a
    fallback that nothing else would show (one failed CUDA session sends every model to the CPU)."""
    return [f"{m['name']} ({m['precision']} on {m['provider']})" for m in models
            if m.get("provider") != CUDA and m.get("precision") != "int8"]


@contextmanager
def started(report: Callable[[str], None], repo: Path, cuda_host: bool, **settings) -> Iterator[tuple[str, int]]:
    """The service on `repo` with `settings`, ready: its URL and supervisor pid, after a line of what /models says
    (and an alarm, on a CUDA host, for each model it serves on the CPU)."""
    with running_service(model_repository=repo, queue_limit=4096, access_log=False, **settings) as url:
        supervisor = supervisor_pid(int(url.rsplit(":", 1)[1]))
        models = httpx.get(f"{url}/models", timeout=10).json()["models"]
        report(f"{len(census.snapshot([supervisor]).threads)} threads at rest; /models: " + "; ".join(
            f"{m['name']}: {m['precision']} on {m['provider']}, decode {m['decode']}"
            + (f" ({m['decode_reason']})" if m.get("decode_reason") else "") for m in models))
        if cuda_host and (fallen := cpu_served(models)):
            report(f"{ALARM}on a CUDA host, served on the CPU: {', '.join(fallen)}")
        yield url, supervisor


def preamble(report: Callable[[str], None], cache: Path, cuda: bool, seconds: int) -> tuple[list[Path], dict]:
    folders, requests = served(cache, cuda)
    one_thread = decode_cpu_ms(photo_bytes("chelsea", "JPEG", quality=90), read_entry(folders[0]).policy)
    phone = decode_cpu_ms(phone_photo(), read_entry(folders[0]).policy)
    report(f"{MODEL} ({'fp16 sibling on CUDA' if cuda else 'fp32 on the CPU'}); wrk threads {wrk_threads()}, "
           f"{seconds} s measured within 1 + {seconds} + 1 s per level; GPU % = NVML utilisation mean/max, cores = "
           f"busy host cores of {os.cpu_count()} (wrk's included); CPU ms per image of the HTTP workers together, "
           f"the inference process, wrk, and the host's busy cores (everything); decoding and resizing the 451 x 300 "
           f"JPEG costs one idle thread of this host {one_thread:.2f} ms, the 12 MP one {phone:.1f} ms")
    return folders, requests


def conns(label: str, clients: int) -> int:
    """A level's connections: at most 64 for the 12 MP photo (each upload 4 MB)."""
    return min(clients, 64) if label == "/classify 12 MP" else clients


def measured(report: Callable[[str], None], url: str, supervisor: int, request: wrk.Request, label: str,
             clients: int, seconds: int) -> Level | None:
    """One level and its row; None (the failure told) where it fails, and the next level runs."""
    try:
        m = level(url, supervisor, request, conns(label, clients), seconds)
    except Exception as e:  # noqa: BLE001 - the level's failure, recorded
        report(f"{label:<18} {conns(label, clients):>5} FAILED: {type(e).__name__}: {' '.join(str(e).split())}")
        return None
    report(row(label, conns(label, clients), m))
    return m


def service(report: Callable[[str], None], cache: Path, cuda: bool, cuda_host: bool, clients: int, seconds: int,
            switches: list[str], rounds: int) -> None:
    """SERVICE_LEVELS at each switch against the default, interleaved (schedule), each from a fresh start; then
    each level's img/s against the default's median."""
    from gpu import repository_of
    folders, requests = preamble(report, cache, cuda, seconds)
    if not cuda and (skipped := [s for s in switches if s in GPU_ONLY]):
        switches = [s for s in switches if s not in GPU_ONLY]
        report(f"{', '.join(skipped)}: not run (the CUDA provider does not start here)")
    runs: dict[tuple[str, str], list[Level]] = {}
    failed = 0
    with repository_of(folders) as repo:
        for switch in schedule(switches, rounds):
            report(f"\n{switch} {SWITCHES[switch] or ''}:")
            with traces_exported(switch == "traces") as spans:
                with started(report, repo, cuda_host, **SWITCHES[switch]) as (url, supervisor):
                    report(HEADER)
                    for label in SERVICE_LEVELS:
                        m = measured(report, url, supervisor, requests[label], label, clients, seconds)
                        failed += m is None
                        if m is not None:
                            runs.setdefault((switch, label), []).append(m)
                if spans is not None:  # the service stopped: what it had queued is exported
                    report(f"{sum(spans):,} spans received by the OTLP receiver")
    for label in SERVICE_LEVELS:
        if not (default := runs.get(("default", label))):
            continue
        base = statistics.median(m.figures.images_per_s for m in default)
        report(f"\n{label} at {conns(label, clients)} connections: img/s against the default's median "
               f"({base:,.0f} over {len(default)} runs)")
        for (switch, of), done in runs.items():
            if of == label:
                rate = statistics.median(m.figures.images_per_s for m in done)
                ms = {k: statistics.median(m.per_image[k] for m in done) for k in ("all", WORKERS, INFERENCE)}
                report(f"  {switch:<26} {rate:>9,.0f} img/s  {rate / base:>5.2f}x  p99 "
                       f"{statistics.median(m.figures.p99_ms for m in done):>6.1f} ms  host {ms['all']:.3f} ms/img  "
                       f"HTTP {ms[WORKERS]:.3f}  infer {ms[INFERENCE]:.3f}  ({len(done)} runs)")
    if failed:
        raise PartFailed(f"{failed} level(s) failed")


def census_levels(report: Callable[[str], None], cache: Path, cuda: bool, cuda_host: bool, clients: int,
                  seconds: int) -> None:
    """CENSUS_LEVELS at the default settings, each with its census."""
    from gpu import repository_of
    folders, requests = preamble(report, cache, cuda, seconds)
    failed = 0
    with repository_of(folders) as repo, started(report, repo, cuda_host) as (url, supervisor):
        report(HEADER)
        for label in CENSUS_LEVELS:
            m = measured(report, url, supervisor, requests[label], label, clients, seconds)
            failed += m is None
            if m is not None:
                report("\n".join(m.census) + "\n")
    if failed:
        raise PartFailed(f"{failed} level(s) failed")


def wrk_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 4))


# a profiled thread's leaf frame that is a wait, not work: idle pool threads, event loops, locks
WAITS = ("_worker (concurrent", "EpollSelector.select", "Runner.run (asyncio", "wait (threading", "Condition.wait")


def busy_threads(stacks: str, seconds: float, rate: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """py-spy's raw (collapsed) stacks of a server and its subprocesses as (process, threads busy, its busiest
    leaf frames with their share), the busiest process first."""
    busy: dict[str, dict[str, int]] = {}
    roles: dict[str, str] = {}
    for line in stacks.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        pid = (frames[1] if frames[1].startswith("process ") else frames[0]).split(":")[0]
        for role, entry in (("inference", "inference_main"), ("HTTP worker", "worker_main")):
            if entry in stack:
                roles[pid] = role
        if count.isdigit() and not frames[-1].startswith(WAITS):
            leaves = busy.setdefault(pid, {})
            leaves[frames[-1]] = leaves.get(frames[-1], 0) + int(count)
    busy = {f"{pid} ({roles[pid]})" if pid in roles else pid: leaves for pid, leaves in busy.items()}
    rows = [(key, sum(leaves.values()) / (seconds * rate),
             [(leaf, n / sum(leaves.values())) for leaf, n in sorted(leaves.items(), key=lambda x: -x[1])[:5]])
            for key, leaves in busy.items()]
    return sorted(rows, key=lambda row: -row[1])


def profile(report: Callable[[str], None], cache: Path, cuda: bool, clients: int, seconds: int, max_batch: int) -> None:
    """py-spy on the service (and its subprocesses) through one level each of /classify with 1 JPEG (GPU decoding
    off) and /v2 with 8 images: where each process's threads are busy, the busiest first."""
    from gpu import repository_of
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise PartFailed(report("py-spy is not installed here (pip install py-spy): not run") or "no py-spy")
    folders, requests = served(cache, cuda)
    rate = 50
    report(f"py-spy record --subprocesses -r {rate} -f raw, {seconds} s within a {seconds + 1} s level at {clients} "
           f"connections, max batch {max_batch}, GPU decoding off; threads busy = samples not waiting / "
           f"({seconds} s x {rate}/s)")
    with repository_of(folders) as repo, running_service(model_repository=repo, gpu_decode=False,
                                                         max_batch_size=max_batch, queue_limit=4096,
                                                         access_log=False) as url:
        port = url.rsplit(":", 1)[1]
        server = output("pgrep", "-f", "--", f"-m service --port {port}").split()[0]
        for label in ("/classify 1 JPEG", "/v2 UINT8 8 img"):
            wrk.run(url, requests[label], clients, 1, wrk_threads())
            with tempfile.NamedTemporaryFile(suffix=".txt") as out:
                recording = subprocess.Popen([spy, "record", "--subprocesses", "-r", str(rate), "-d", str(seconds),
                                              "-f", "raw", "-o", out.name, "-p", server], stdout=subprocess.DEVNULL,
                                             stderr=subprocess.STDOUT)
                f = wrk.run(url, requests[label], clients, seconds + 1, wrk_threads())
                recording.wait()
                stacks = Path(out.name).read_text()
            rows = busy_threads(stacks, seconds, rate)
            report(f"\n{label}: {f.images_per_s:,.0f} img/s; {sum(r[1] for r in rows):.1f} threads busy in "
                   f"{len(rows)} processes")
            for key, threads, leaves in rows[:3]:
                report(f"  {key}: {threads:.2f} threads busy")
                for leaf, share in leaves:
                    report(f"    {share:4.0%}  {leaf}")


@dataclass(frozen=True)
class Part:
    """One part of the check: the command that runs it, in a process of its own, and its time box."""
    name: str
    argv: list[str]
    box_s: float


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # "ok", "FAILED" (its exit status), "CUT" (killed at its box)
    seconds: float
    box_s: float

    def __str__(self) -> str:
        return f"{self.name:<9} {self.status:<6} {self.seconds:5.0f} s of its {self.box_s:.0f} s box"


def run_part(report: Callable[[str], None], part: Part, alarms: list[str]) -> Outcome:
    """The part's command in the project root, its output into the report line by line (its ALARM lines kept in
    `alarms` too), killed at its box with every process it started (a test's service, torch.compile's workers)."""
    report(f"\n== {part.name} (box {part.box_s:.0f} s)")
    report(f"$ {shlex.join(part.argv)}")
    start = time.monotonic()
    proc = subprocess.Popen(part.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def read() -> None:
        for line in proc.stdout:
            report(line.rstrip())
            if line.startswith(ALARM):
                alarms.append(f"{part.name}: {line.removeprefix(ALARM).strip()}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(part.box_s)
        cut = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        cut = True
    reader.join(5)  # a process that left the group may hold the pipe: its lines are not waited for
    status = "CUT" if cut else "ok" if proc.returncode == 0 else "FAILED"
    return Outcome(part.name, status, time.monotonic() - start, part.box_s)


def run_parts(report: Callable[[str], None], summary: Path, head: str, parts: list[Part],
              alarms: list[str]) -> list[Outcome]:
    """Each part in turn; the summary rewritten before the first and after each: the alarms at its top, then each
    part's outcome, then the parts not run yet."""
    outcomes: list[Outcome] = []

    def tell() -> None:
        lines = [head, *(f"{ALARM}{a}" for a in alarms), *map(str, outcomes),
                 *(f"{p.name:<9} not run (yet)" for p in parts[len(outcomes):])]
        summary.write_text("\n".join(lines) + "\n")

    tell()
    for part in parts:
        outcomes.append(run_part(report, part, alarms))
        tell()
    return outcomes


def export_cache(cache: Path) -> None:
    """What the check needs, exported here (the GPU host's torch cannot): for each of GRAPH_MODELS fp32 and fp16
    repository folders, and the fp16 graph without ORT's fusions that bench/gpu.py's graphs part times beside them,
    all without their weights (bench/weightless.py: the check draws new ones there)."""
    from gpu import export, fp16_variant

    from export.fusion import REWRITES
    for model in GRAPH_MODELS:
        for precision in ("fp32", "fp16"):
            export(cache, model, precision)
        fp16_variant(cache, model, tuple(REWRITES))
    strip_all(cache)
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    print(f"{cache}: {size / 2**20:.0f} MiB; stage it with `python bench/gpu_stage.py pack --cache {cache}`")


def gpu_seen() -> bool:
    return shutil.which("nvidia-smi") is not None and device().startswith("NVIDIA")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("BENCH_CACHE", "/tmp/gpu-stage/cache")),
                   help="the exported graphs (default: $BENCH_CACHE, else /tmp/gpu-stage/cache, where "
                        "bench/gpu_setup.sh puts staged ones)")
    p.add_argument("--export-cache", type=Path, metavar="DIR",
                   help="export the graphs the check needs into DIR (on a host whose torch can) and stop")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the report and its summary go (default: "
                                                             "bench/results; on the device, $OUT)")
    p.add_argument("--parts", nargs="+", choices=BOXES, default=list(BOXES), help="which parts, always in this order")
    p.add_argument("--budget", type=float, default=BUDGET,
                   help=f"seconds for all the parts chosen, shared as BOXES shares {BUDGET} (default: {BUDGET})")
    p.add_argument("--expect-cuda", action="store_true",
                   help="take this host for a CUDA host (as a GPU that nvidia-smi sees does): serving on the CPU is "
                        "an alarm")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 s levels at 64 connections, 1 graph round")
    p.add_argument("--clients", type=int, help="wrk connections per level (default: 256; 64 with --quick)")
    p.add_argument("--seconds", type=int, help="per service level, after 1 s of warm-up (default: 3; 1 with --quick)")
    p.add_argument("--switches", nargs="*", choices=[k for k in SWITCHES if k != "default"],
                   default=SERVICE_SWITCHES, help="the service part's, each against the default")
    p.add_argument("--rounds", type=int, default=1, help="the switches this many times over")
    p.add_argument("--max-batch-size", type=int, default=16, help="the profile's (VITSERVE_MAX_BATCH_SIZE)")
    p.add_argument("--run-part", choices=["service", "census", "profile"], help=argparse.SUPPRESS)  # the driver's
    p.add_argument("--cuda", action="store_true", help=argparse.SUPPRESS)  # the driver's probe, for --run-part
    args = p.parse_args()
    if args.export_cache:
        return export_cache(args.export_cache)
    clients = args.clients or (64 if args.quick else 256)
    seconds = args.seconds or (1 if args.quick else 3)
    if args.run_part:  # in the process the driver started for it
        say = partial(print, flush=True)
        run = {"service": lambda: service(say, args.cache, args.cuda, args.expect_cuda, clients, seconds,
                                          args.switches, args.rounds),
               "census": lambda: census_levels(say, args.cache, args.cuda, args.expect_cuda, clients, seconds),
               "profile": lambda: profile(say, args.cache, args.cuda, clients, seconds, args.max_batch_size)}
        try:
            run[args.run_part]()
        except PartFailed as e:
            sys.exit(f"{args.run_part}: {e}")
        return
    began, now, source = time.monotonic(), datetime.now(timezone.utc), commit()
    stem = f"gpu-{now:%Y-%m-%d}-{source}"
    report = Report(args.out / f"{stem}.txt")
    report(f"{shlex.join(['bench/gpu_check.py', *sys.argv[1:]])}, {now:%Y-%m-%d %H:%M} UTC, commit {source}")
    alarms: list[str] = []
    try:  # as the service decides, on its smallest embedded graph
        cuda = choose_device([read_entry(ROOT / "model_repository" / "shapes-vit")], None) == CUDA
    except Exception as e:  # noqa: BLE001 - the CPU then, and why
        cuda = False
        report(f"the CUDA provider's probe failed: {type(e).__name__}: {e}")
    cuda_host = args.expect_cuda or gpu_seen()
    report(f"device: {device()}; CUDA provider {'starts' if cuda else 'does not start: CUDA parts not run'}")
    if cuda_host and not cuda:
        alarms.append("check: a CUDA host (" + ("--expect-cuda" if args.expect_cuda else "nvidia-smi sees a GPU")
                      + ") whose CUDA provider does not start: every model is served on the CPU")
        report(ALARM + alarms[-1])
    report(f"host: {cpus()}, Python {platform.python_version()}; onnxruntime {ort.__version__}, "
           f"providers {', '.join(ort.get_available_providers())}; cache {args.cache}")
    start = time.monotonic()
    if refilled := refill_all(args.cache):
        report(f"{len(refilled)} graphs staged without their weights given new ones (bench/weightless.py) in "
               f"{time.monotonic() - start:.0f} s")
    python, check = sys.executable, str(Path(__file__).resolve())
    own = ["--cache", str(args.cache), "--clients", str(clients), "--seconds", str(seconds),
           "--rounds", str(args.rounds), "--max-batch-size", str(args.max_batch_size), "--switches", *args.switches,
           *(["--cuda"] if cuda else []), *(["--expect-cuda"] if cuda_host else [])]
    graph_rounds = ["--rounds", "1", "--seconds", "1" if args.quick else "2"]
    argv = {"tests": [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--numprocesses",
                      str(max(1, min(8, (os.cpu_count() or 2) // 2))), "--dist", "load", "tests/test_gpu.py",
                      "tests/test_gpu_decode.py"],
            "graphs": [python, "bench/gpu.py", "--parts", "graphs", "--models", *(GRAPH_MODELS if cuda else [MODEL]),
                       "--batches", "256", "--cache", str(args.cache), *graph_rounds],
            "decode": [python, "bench/gpu.py", "--parts", "decode", "--models", MODEL, "--cache", str(args.cache)],
            "ops": [python, "bench/op_profile.py", *(
                [str(args.cache / f"{GRAPH_MODELS[1]}-fp16"), "--batch", "256", "--cuda"] if cuda
                else [str(args.cache / MODEL), "--batch", "8"])],
            "engines": [python, "bench/jpeg_engines.py", *(["--quick"] if args.quick else [])],
            "relevance": [python, "bench/relevance.py", "--parts", "cost", *(["--cuda"] if cuda else [])]}
    argv |= {name: [python, check, "--run-part", name, *own] for name in ("service", "census", "profile")}
    scale = args.budget / sum(BOXES[name] for name in args.parts)
    parts = [Part(name, argv[name], BOXES[name] * scale) for name in BOXES if name in args.parts]
    summary = args.out / f"{stem}-summary.txt"
    outcomes = run_parts(report, summary, f"bench/gpu_check.py at {source} on {device()}, {now:%Y-%m-%d %H:%M} UTC; "
                         f"{args.budget:.0f} s for {len(parts)} parts; the report: {stem}.txt", parts, alarms)
    report(f"\n== summary ({time.monotonic() - began:.0f} s in all)\n" + summary.read_text().rstrip())
    print(f"written to {report.path} and {summary}")
    sys.exit(bool(alarms) or any(o.status != "ok" for o in outcomes))


if __name__ == "__main__":
    main()
