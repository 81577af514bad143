"""Triton's perf_analyzer against vitserve, unchanged: tritonclient 2.40.0's manylinux wheel is the last on PyPI that
ships the binary (the newer `perf-analyzer` name is an empty 0.1.0). It needs no GPU, but two libraries to start:
libb64.so.0d (Debian's libb64-0d) and libcudart.so.12 (nvidia-cuda-runtime-cu12's wheel, kept beside it).

    python bench/perf_analyzer.py install                  # build/perf_analyzer/ (make perf-analyzer; CI does it)
    python bench/perf_analyzer.py compare --rounds 3       # docs/performance.md's comparison

`compare` starts `python -m service --backend process` on the `null` repository (bench/service_overhead.py:
shapes-deit's interface over a graph that reads one value of each image, so that the CPU measured is the service's
own) and, at each client count and number of images per request, alternates three loads on `/v2`: service.loadtest
(HTTP, binary tensor extension, random uint8 images), perf_analyzer over HTTP (binary, one real photo's pixels) and
perf_analyzer over HTTP with its tensors in system shared memory. Each gives images/s, as that load generator
reports it, and the HTTP workers' CPU per image: their CPU seconds over the run (from /proc, as
bench/process_cost.py reads them) divided by the images the server ran meanwhile (its statistics). Figures are
medians of the rounds.
"""
import argparse
import base64
import csv
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "build" / "perf_analyzer"
WHEELS = {"tritonclient==2.40.0": ("tritonclient-2.40.0.data/data/bin/perf_analyzer", "perf_analyzer"),
          "nvidia-cuda-runtime-cu12==12.9.79": ("nvidia/cuda_runtime/lib/libcudart.so.12", "lib/libcudart.so.12")}


def install(folder: Path = FOLDER) -> None:
    """The binary and the CUDA runtime it links, out of their wheels (downloaded, then deleted)."""
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "manylinux1_x86_64", "--platform",
                        "manylinux2014_x86_64", "-d", wheels, *WHEELS], check=True)
        for wheel in Path(wheels).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for member, target in WHEELS.values():
                    if member in archive.namelist():
                        path = folder / target
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(archive.read(member))
                        path.chmod(0o755)
    print(f"perf_analyzer in {folder}: {why_not(folder) or 'it starts'}")


def environment(folder: Path = FOLDER) -> dict[str, str]:
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(folder / "lib"),
                                                                         os.environ.get("LD_LIBRARY_PATH")]))}


def why_not(folder: Path = FOLDER) -> str | None:
    """Why perf_analyzer cannot run here, or None where it can."""
    binary = folder / "perf_analyzer"
    if platform.machine() != "x86_64":
        return f"perf_analyzer's wheel is for x86_64, and this machine is {platform.machine()}"
    if not binary.exists():
        return f"{binary} is missing: make perf-analyzer"
    started = subprocess.run([str(binary), "--version"], env=environment(folder), capture_output=True, text=True)
    if "error while loading shared libraries" in started.stderr:
        missing = started.stderr.split("error while loading shared libraries:")[1].split(":")[0].strip()
        return f"perf_analyzer cannot start: {missing} is missing" + (
            " (apt-get install libb64-0d)" if "b64" in missing else "")
    return None


def input_data(pixels, path: Path) -> Path:
    """perf_analyzer's --input-data file: one image, as the model's uint8 `images` input."""
    path.write_text(json.dumps({"data": [{"images": {"b64": base64.b64encode(pixels.tobytes()).decode()}}]}))
    return path


@dataclass
class Report:
    """What perf_analyzer measured at one concurrency: its CSV row (latencies and server times in usec)."""
    row: dict[str, float]
    output: str  # what it printed

    @property
    def inferences_per_s(self) -> float:
        return self.row["Inferences/Second"]

    def server_us(self, part: str) -> float:
        """The server's mean per request: "Queue", "Compute Input", "Compute Infer" or "Compute Output"."""
        return self.row[f"Server {part}"]


def run(model: str, url: str, *options: str, timeout: float = 120, folder: Path = FOLDER) -> Report:
    """One perf_analyzer run (its own flags in `options`) at one concurrency; its CSV report."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.csv"
        done = subprocess.run([str(folder / "perf_analyzer"), "-m", model, "-u", url, "-f", str(report), *options],
                              env=environment(folder), capture_output=True, text=True, timeout=timeout)
        output = done.stdout + done.stderr
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"perf_analyzer {' '.join(options)} failed ({done.returncode}):\n{output}")
        row = next(csv.DictReader(io.StringIO(report.read_text())))
    return Report({k: float(v) for k, v in row.items() if v not in ("", None)}, output)


# -- compare -------------------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["install", "compare"])
    p.add_argument("--clients", type=int, nargs="+", default=[16])
    p.add_argument("--images", type=int, nargs="+", default=[1, 8], help="images per request")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    if args.action == "install":
        return install()
    compare(args)


def served_images(url: str, model: str) -> int:
    """The images the server has run for the model: its statistics' inference_count."""
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats") as r:
        return json.load(r)["model_stats"][0]["inference_count"]


def compare(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
    from process_cost import cpu_by_role, supervisor_pid
    from service_overhead import null_repo
    from service_process import model_pixels, photo_bytes, running_service

    from service.supervisor import ROLES

    if (reason := why_not()) is not None:
        raise SystemExit(reason)
    model = "null"
    pixels = model_pixels(ROOT / "model_repository" / "shapes-deit", photo_bytes("chelsea", "JPEG"))
    with tempfile.TemporaryDirectory() as scratch, running_service(
            model_repository=null_repo(Path(scratch)), backend="process", workers=args.workers, access_log="false",
            max_batch_size=64, queue_limit=1024) as url:
        data = input_data(pixels, Path(scratch) / "photo.json")
        supervisor = supervisor_pid(int(url.rsplit(":", 1)[1]))
        window = str(int(args.seconds * 1000 / 3))  # perf_analyzer measures 3 windows (-r 3, stable at once)

        def perf(clients: int, images: int, *extra: str):
            return lambda: run(model, url.removeprefix("http://"), "-i", "http", "-b", str(images), "--input-data",
                               str(data), "--concurrency-range", str(clients), "--measurement-interval", window,
                               "-s", "1000", "-r", "3", *extra).inferences_per_s

        def loadtest(clients: int, images: int):
            def go() -> float:
                out = Path(scratch) / "loadtest.json"
                subprocess.run([sys.executable, "-m", "service.loadtest", "--url", url, "--model", model, "--v2",
                                "UINT8", "--files-per-request", str(images), "--concurrency", str(clients),
                                "--duration", str(args.seconds), "--json", str(out)], cwd=ROOT, capture_output=True,
                               check=True)
                return json.loads(out.read_text())[0]["images_per_s"]
            return go

        print(f"/v2 on the null model (96 x 96 uint8 images), the process backend with {args.workers} HTTP workers and "
              f"the load generator on this host ({os.cpu_count()} CPUs); {args.rounds} interleaved rounds of "
              f"{args.seconds:g}s, medians")
        print(f"{'clients':>7} {'img/req':>7} {'load':<38} {'images/s':>9} {'workers CPU ms/image':>21}")
        for clients in args.clients:
            for images in args.images:
                loads = {"service.loadtest, HTTP binary": loadtest(clients, images),
                         "perf_analyzer, HTTP binary": perf(clients, images),
                         "perf_analyzer, system shared memory": perf(clients, images, "--shared-memory", "system")}
                figures: dict[str, list[tuple[float, float]]] = {name: [] for name in loads}
                for _ in range(args.rounds):
                    for name, go in loads.items():
                        before, served = cpu_by_role(supervisor)[ROLES[1]], served_images(url, model)
                        rate = go()
                        spent = cpu_by_role(supervisor)[ROLES[1]] - before
                        figures[name].append((rate, spent / (served_images(url, model) - served) * 1e3))
                for name, runs in figures.items():
                    print(f"{clients:>7} {images:>7} {name:<38} {statistics.median(r for r, _ in runs):>9,.0f} "
                          f"{statistics.median(c for _, c in runs):>21.3f}", flush=True)


if __name__ == "__main__":
    main()
