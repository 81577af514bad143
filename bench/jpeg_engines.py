"""nvImageCodec's JPEG decode alone (no resize, no service), configuration by configuration: which GpuDecoder to
build (issue 59's engine experiments, E0-E5). Each line: images/s, and the host's CPU ms per image (getrusage: every
thread of this process, nvImageCodec's own included).

    python bench/jpeg_engines.py                        # every experiment, on the GPU (2-3 minutes, 42 measurements)
    python bench/jpeg_engines.py --experiments E1 E4 --seconds 5
    python bench/jpeg_engines.py --quick                # every code path once, briefly; without a GPU,
                                                        # nvImageCodec's CPU decoder stands in (no figure means much)

Images: the 451 x 300 chelsea photo, a 12 MP phone photo and six sizes mixed (bench/jpegs.py), each batch the set
repeated. Each Python thread has a Decoder and a non-blocking CUDA stream of its own, as the service's inference
threads do, decodes a warm-up batch (which fixes the JPEG engines' share for good) and then batches back to back,
synchronising each, for --seconds; the threads start together.

E0  the decoder's own account of a batch of 64 (PYNVIMGCODEC_VERBOSITY=3, in a child process): its lines naming
    the engines, the mini-batch, the batch-single path and the batch size it settles on.
E1  the legacy batched call (nvjpegDecodeBatchedEx, on the calling thread alone) against
    nvjpeg_hw_decoder:force_batch_single=1 (a worker stream per engine), x max_num_cpu_threads 4 and 8, x 2, 4 and
    8 Python threads; batch 64.
E2  fancy upsampling off against on (the service's), on E1's best.
E3  memory, on E1's best: the default pool keeping what it frees (release threshold 64 GiB, not 0); each thread's
    outputs decoded into again (`images=`); the hardware decoder's preallocation hints (batch, width, height).
E4  the 12 MP photo: HW_GPU_ONLY with load_hint 0.5, 0.65, 0.8, 1.0 (GPU_ONLY taking the rest, as the service
    lists them), the same with the adaptive load-hint policy, and HYBRID_CPU_GPU alone.
E5  batch 16 against 64 on the best of E1-E3.
"""
import argparse
import faulthandler
import os
import re
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.jpegs import MIXED, jpeg, phone_photo  # noqa: E402

EXPERIMENTS = ("E0", "E1", "E2", "E3", "E4", "E5")
# what E0 keeps of the decoder's log
E0_PATTERNS = re.compile(r"num_hw_engines|mini_bs|batch.single|selecting max batch size|hw_decoder", re.I)
RELEASE_THRESHOLD = 4  # cudaMemPoolAttrReleaseThreshold


@dataclass(frozen=True)
class Config:
    """One way to decode. `backends`: (kind, load_hint) in nvImageCodec's order of preference."""
    options: str = ":fancy_upsampling=1"  # the service's (gpu_decode.py)
    cpu_threads: int = 4
    threads: int = 2
    batch: int = 64
    backends: tuple = (("HW_GPU_ONLY", 1.0), ("GPU_ONLY", 1.0), ("HYBRID_CPU_GPU", 1.0))
    adaptive: bool = False  # LoadHintPolicy.ADAPTIVE_MINIMIZE_IDLE_TIME, not FIXED
    reuse: bool = False  # each batch decoded into the last one's images
    keep_freed: bool = False  # the default memory pool's release threshold raised

    def label(self) -> str:
        """What sets it apart: the path, the upsampling, threads, batch, and any other choice made."""
        words = ["batch-single" if "force_batch_single=1" in self.options else "legacy",
                 "fancy" if "fancy_upsampling=1" in self.options else "no fancy", f"{self.cpu_threads} cpu_threads",
                 f"{self.threads} threads", f"batch {self.batch}"]
        if self.backends != Config.backends:
            words.append("+".join(kind + (f"@{hint:g}" if hint != 1.0 else "") for kind, hint in self.backends))
        words += [word for word, on in (("preallocated", "preallocate" in self.options), ("adaptive", self.adaptive),
                                        ("reuse", self.reuse), ("pool keeps", self.keep_freed)) if on]
        return ", ".join(words)


class Host:
    """nvImageCodec (and CuPy on the GPU): the GPU where one works, else the CPU decoder in its place."""

    def __init__(self, gpu: bool):
        from nvidia import nvimgcodec
        self.nvimgcodec, self.gpu = nvimgcodec, gpu
        self.cupy = __import__("cupy") if gpu else None
        self.params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB, apply_exif_orientation=True,
                                              allow_any_depth=False)

    def decoder(self, config: Config):
        n = self.nvimgcodec
        if not self.gpu:  # the options and hints are the GPU decoders'; the CPU one ignores them
            return n.Decoder(device_id=n.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[n.Backend(n.CPU_ONLY)],
                             max_num_cpu_threads=config.cpu_threads, options=config.options)
        policy = n.LoadHintPolicy.ADAPTIVE_MINIMIZE_IDLE_TIME if config.adaptive else n.LoadHintPolicy.FIXED
        backends = [n.Backend(getattr(n, kind), load_hint=hint, load_hint_policy=policy)
                    for kind, hint in config.backends]
        return n.Decoder(device_id=0, backends=backends, max_num_cpu_threads=config.cpu_threads,
                         options=config.options)

    def stream(self):
        return self.cupy.cuda.Stream(non_blocking=True) if self.gpu else None

    def keep_freed(self, on: bool) -> None:
        """The default memory pool keeps (or, as by default, gives back at each sync) what it frees."""
        if self.gpu:
            runtime = self.cupy.cuda.runtime
            runtime.memPoolSetAttribute(runtime.deviceGetDefaultMemPool(0), RELEASE_THRESHOLD, (1 << 36) if on else 0)

    def rate(self, config: Config, jpegs: list[bytes], seconds: float) -> tuple[float, float]:
        """(images/s, host CPU ms per image) of `config` on batches of `jpegs` repeated."""
        batch = [jpegs[i % len(jpegs)] for i in range(config.batch)]
        started, stop = threading.Barrier(config.threads + 1), threading.Event()
        done, failures = [0] * config.threads, []
        # each thread's decoder, stream and last images, freed only once every thread has stopped: the H200 run of
        # 2026-12-04 crashed, it seems, as the first thread to stop freed its decoder while another still decoded
        # (bench/results/gpu-2026-12-04-ccf02bb-engines.txt: the faulting thread past its work, the main one joining)
        kept: list[tuple] = [()] * config.threads

        def work(i: int) -> None:
            try:
                decoder, stream = kept[i] = self.decoder(config), self.stream()
                images = run(decoder, stream, None)  # the warm-up: the engines' share fixed here
            except Exception as e:  # noqa: BLE001 - reported with the configuration
                failures.append(e)
                started.abort()
                return
            started.wait()
            while not stop.is_set():
                images = run(decoder, stream, images if config.reuse and None not in images else None)
                done[i] += len(batch)
            kept[i] = (decoder, stream, images)

        def run(decoder, stream, images):
            # images= only to decode into them, as the service never does (the H200 run of 2026-12-04 crashed here)
            into = {"images": images} if images is not None else {}
            out = decoder.decode(batch, params=self.params, cuda_stream=stream.ptr if stream is not None else 0, **into)
            if stream is not None:
                stream.synchronize()
            return out

        self.keep_freed(config.keep_freed)
        workers = [threading.Thread(target=work, args=(i,)) for i in range(config.threads)]
        try:
            for worker in workers:
                worker.start()
            try:
                started.wait()
            except threading.BrokenBarrierError:
                raise failures[0] from None
            start, cpu = time.perf_counter(), _cpu_seconds()
            time.sleep(seconds)
            images, elapsed, used = sum(done), time.perf_counter() - start, _cpu_seconds() - cpu
            stop.set()
        finally:
            stop.set()
            for worker in workers:
                worker.join()
            kept.clear()
            self.keep_freed(False)
        return images / elapsed, used / max(images, 1) * 1e3


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def verbose_log(gpu: bool, data: bytes) -> list[str]:
    """E0: what nvImageCodec says of a batch of 64, at verbosity 3."""
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.jpeg_engines import Config, Host; "
              f"h = Host({gpu}); d = h.decoder(Config()); s = h.stream(); "
              "d.decode([open(sys.argv[1], 'rb').read()] * 64, params=h.params, "
              "cuda_stream=s.ptr if s is not None else 0); s is not None and s.synchronize()")
    path = Path(f"/tmp/jpeg-engines-{os.getpid()}.jpg")
    path.write_bytes(data)
    try:
        out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYNVIMGCODEC_VERBOSITY": "3"})
    finally:
        path.unlink()
    lines = (out.stdout + out.stderr).splitlines()
    kept = [line for line in lines if E0_PATTERNS.search(line)]
    return kept or [f"(none of {len(lines)} lines matched; exit status {out.returncode})", *lines[-5:]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement, after the warm-up batch")
    p.add_argument("--quick", action="store_true", help="every code path once: 0.05 s measurements of batches of 4, "
                                                        "E1 cut down, a 640 x 480 photo for the 12 MP one")
    args = p.parse_args()
    faulthandler.enable()  # a crash inside nvImageCodec names the Python line that called it
    seconds, batch = (0.05, 4) if args.quick else (args.seconds, 64)
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "1")  # errors only (E0's child asks for more)
    try:
        import cupy
        gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver: the CPU decoder stands in
        gpu = False
    host = Host(gpu)
    sets = {"451x300": [jpeg((451, 300))], "12 MP": [jpeg((640, 480)) if args.quick else phone_photo()],
            "mixed": [jpeg(size) for size in (MIXED[:2] if args.quick else MIXED)]}
    print(f"bench/jpeg_engines.py on {'the GPU' if gpu else 'the CPU (nvImageCodec CPU_ONLY; no GPU here)'}, "
          f"{os.cpu_count()} cores; {seconds:g} s a measurement", flush=True)

    def measure(name: str, config: Config, which=tuple(sets)) -> dict[str, float]:
        rates = {}
        for label in which:
            try:
                rate, cpu_ms = host.rate(config, sets[label], seconds)
            except Exception as e:  # noqa: BLE001 - a configuration the decoder refuses is a result too
                print(f"{name} {label}: {config.label()}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            rates[label] = rate
            print(f"{name} {label}: {config.label()}: {rate:,.0f} img/s, {cpu_ms:.3f} CPU ms/img", flush=True)
        return rates

    def best(results: dict[Config, dict[str, float]]) -> Config:
        """The configuration with the highest 451 x 300 rate (the service's common case), else the first."""
        return max(results, key=lambda c: results[c].get("451x300", 0.0))

    chosen = Config(batch=batch)
    if "E0" in args.experiments:
        for line in verbose_log(gpu, sets["451x300"][0]):
            print(f"E0: {line}", flush=True)
    if "E1" in args.experiments:
        paths = {"legacy": ":fancy_upsampling=1", "batch-single": ":fancy_upsampling=1 "
                                                                 "nvjpeg_hw_decoder:force_batch_single=1"}
        grid = [(options, cpu, threads) for options in paths.values() for cpu in (4, 8) for threads in (2, 4, 8)]
        if args.quick:
            grid = grid[::5]
        results = {(c := Config(options, cpu, threads, batch)): measure("E1", c) for options, cpu, threads in grid}
        chosen = best(results)
        print(f"E1 best: {chosen.label()}", flush=True)
    if "E2" in args.experiments:
        off = replace(chosen, options=chosen.options.replace(":fancy_upsampling=1", ":fancy_upsampling=0"))
        results = {chosen: measure("E2", chosen), off: measure("E2", off)}
        print(f"E2 best: {best(results).label()} (fancy upsampling off needs bench/preprocess_agreement.py's "
              "accuracy check before the service uses it)", flush=True)
    if "E3" in args.experiments:
        hints = (f" nvjpeg_hw_decoder:preallocate_batch_size={chosen.batch} "
                 "nvjpeg_hw_decoder:preallocate_width_hint=4032 nvjpeg_hw_decoder:preallocate_height_hint=3024")
        variants = [chosen, replace(chosen, keep_freed=True), replace(chosen, reuse=True),
                    replace(chosen, options=chosen.options + hints),
                    replace(chosen, keep_freed=True, reuse=True, options=chosen.options + hints)]
        results = {config: measure("E3", config) for config in variants}
        chosen = best(results)
        print(f"E3 best: {chosen.label()}", flush=True)
    if "E4" in args.experiments:
        rest = (("GPU_ONLY", 1.0), ("HYBRID_CPU_GPU", 1.0))
        variants = [replace(chosen, backends=(("HW_GPU_ONLY", hint), *rest)) for hint in (0.5, 0.65, 0.8, 1.0)]
        variants += [replace(chosen, backends=(("HW_GPU_ONLY", 0.65), *rest), adaptive=True),
                     replace(chosen, backends=(("HYBRID_CPU_GPU", 1.0),))]
        for config in variants:
            measure("E4", config, ("12 MP",))
    if "E5" in args.experiments:
        for size in (batch // 4, batch):
            measure("E5", replace(chosen, batch=size))


if __name__ == "__main__":
    main()
