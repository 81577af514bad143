"""The GPU baseline (../shared/gpu/README.md) reproduced: graphs, the service, and image decoding, with the
service's figures divided by the raw session's.

    python bench/gpu.py                                  # everything this host can run
    python bench/gpu.py --models deit_tiny_patch16_224 --batches 64 256 --parts graphs

graphs:  images/s of each model at each batch, the variants alternating round by round (medians):
         ORT fp32/fp16 "dev" (input and outputs resident on the GPU, IOBinding with OrtValues; fp16 as exported,
         with ORT's fused kernels written in, and "fp16 unfused", converted without those fusions (--ablate: also
         without each one in turn, or each one named); at batch <= 8 also "fp16 CUDA graph", exported for exactly
         that batch and replayed as a CUDA graph), the service's `Runner` (the batch gathered into its page-locked
         host buffer, outputs copied back; "pageable": gathered into plain memory; "2 threads": two batches at a time
         from two threads, as the service's inference threads run them, over one session or one each; at batch <= 8 also
         with its CUDA graph, the dynamic graph's batch fixed at load), the project's PyTorch model in fp16, eager and
         under torch.compile (inductor; compiled once per batch size, not timed), timm with AMP and channels_last if it
         imports. Without CUDA: ORT fp32 on the CPU, Runner, PyTorch fp32 eager.
service: `python -m service` (the backend it picks for this host) on the first model, with its fp16 sibling
         on CUDA; /classify with 451 x 300 JPEGs (1 and 8 per request) and /v2 (FP32 and UINT8 tensors, binary
         outputs) at each client count, the clients spread over several processes; images/s, p50/p99, and the
         service's figure divided by the raw session's at the service's max batch size.
decode:  the service's CPU path (upload_input: draft decode, OpenCV warp) on a thread per core, against its GPU
         decoder (nvImageCodec, then the batched matrix resize) on batches of 1, 16 and 64, from one thread and from
         two (as the two inference threads call it), on a 451 x 300 and a 1920 x 1080 JPEG.
What cannot run here (no CUDA, no timm, no nvImageCodec) is named, not silently left out. Models are exported
once, random-init, into --cache; on a host whose torch cannot run the project's export (a GPU host's image), a graph
missing from --cache stops the run with the command that exports it (docs/development.md#the-gpu-check).
"""
import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from service_process import running_service  # noqa: E402

from bench.export_speed import fp16_graph, fp16_graph_path  # noqa: E402
from bench.jpegs import MIXED, jpeg, phone_photo  # noqa: E402
from bench.weightless import refill_all  # noqa: E402
from export.fusion import REWRITES  # noqa: E402
from repository import InputPolicy, read_entry  # noqa: E402
from service.images.decode import decode, model_input, upload_input  # noqa: E402
from service.loadtest import classify_requests, run_level_processes, v2_requests  # noqa: E402
from service.engine.runtime import CPU, CUDA, Runner, choose_device, pinned_empty  # noqa: E402

CUDA_GRAPH_MAX_BATCH = 8  # a CUDA graph saves kernel launches, which only small batches notice
# the CUDA provider's `sdpa_kernel` option: which attention kernel ORT must use (0, its default, picks one)
SDPA_KERNELS = {"flash": 1, "efficient": 2, "trt-fused": 4, "cudnn": 8, "math": 16}
CUDA_MODELS = ["deit_tiny_patch16_224", "deit_small_patch16_224", "vit_base_patch16_224",
               "swin_tiny_patch4_window7_224"]
skipped: list[str] = []


class MissingGraph(RuntimeError):
    """A graph the run needs is not in --cache, and this host cannot export it."""


@cache
def cannot_export() -> str | None:
    """Why this host cannot run the project's export (its torch is not the one requirements.lock pins), or None."""
    import torch
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M)
    have = torch.__version__.split("+")[0]
    return f"its torch is {have}, the export needs the pinned {pinned[1]}" if pinned and have != pinned[1] else None


def exportable(path: Path, how: str) -> None:
    """MissingGraph where `path` is missing and this host cannot export it: never a failed export half-way."""
    if not path.exists() and (why := cannot_export()):
        raise MissingGraph(f"{path} is not in the cache, and this host cannot export it ({why}): {how} on the CPU "
                           "host and carry the cache here (docs/development.md#the-gpu-check)")


def export(cache: Path, model: str, precision: str = "fp32") -> Path:
    """The model's repository folder, exported once (random-init weights: speed does not depend on them)."""
    name = model if precision == "fp32" else f"{model}-{precision}"
    exportable(cache / name / "manifest.json",
               f"`python -m export {model} --random-init --no-explain --precision {precision} --out {cache}`")
    if not (cache / name / "manifest.json").exists():
        from export.__main__ import main as export_main
        export_main([model, "--random-init", "--no-explain", "--precision", precision, "--out", str(cache)])
    return cache / name


def fp16_variant(cache: Path, model: str, without: tuple[str, ...] = (), batch: int | None = None) -> Path:
    """bench/export_speed.py's fp16_graph, exported only where this host can."""
    exportable(fp16_graph_path(cache, model, without, batch), "export it with bench/export_speed.py's fp16_graph "
               "(`python bench/gpu_check.py --export-cache DIR` writes the unfused one)")
    return fp16_graph(cache, model, without, batch)


def median_rates(calls: dict, batch: int, rounds: int, seconds: float) -> dict[str, float]:
    """images/s of each call (one batch each, or as many images as it returns), the calls in a new order every
    round; medians over rounds."""
    for call in calls.values():
        call()
    rates = {k: [] for k in calls}
    for _ in range(rounds):
        for k in random.sample(list(calls), len(calls)):
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / len(calls):
                done += calls[k]() or batch
            rates[k].append(done / (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in rates.items()}


def ort_on_device(folder: Path, batch: int, graph: Path | None = None, sdpa_kernel: int = 0):
    """One run with the uint8 input and every output resident on the GPU (`graph`: another graph for the same
    inputs and outputs; `sdpa_kernel`: the CUDA provider's attention kernel forced, SDPA_KERNELS). fp32 math
    without TF32, as the service's default (VITSERVE_CUDA_TF32) runs it; ORT's own default is TF32."""
    entry = read_entry(folder)
    options = {"use_tf32": "0"} | ({"sdpa_kernel": str(sdpa_kernel)} if sdpa_kernel else {})
    session = ort.InferenceSession(str(graph or entry.path()), providers=[(CUDA, options)])
    h, w = entry.policy.size
    binding = session.io_binding()
    images = ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, h, w, 3), np.uint8), "cuda", 0)
    binding.bind_ortvalue_input(entry.manifest["input"]["name"], images)
    binding.bind_cpu_input(entry.manifest["tensor_input"]["name"], np.zeros((0, 3, h, w), np.float32))
    for output in session.get_outputs():
        binding.bind_output(output.name, "cuda")
    return lambda: session.run_with_iobinding(binding)


def cuda_graph_on_device(model: str, batch: int, cache: Path):
    """The fp16 graph exported for exactly `batch` images (no shape arithmetic left to run on the CPU), captured
    once as a CUDA graph and replayed; inputs and outputs stay at fixed GPU addresses, as replay needs."""
    session = ort.InferenceSession(str(fp16_variant(cache, model, batch=batch)),
                                   providers=[(CUDA, {"enable_cuda_graph": "1"})])
    binding = session.io_binding()
    for spec in session.get_inputs():
        zeros = np.zeros(spec.shape, np.uint8 if spec.type == "tensor(uint8)" else np.float32)
        binding.bind_ortvalue_input(spec.name, ort.OrtValue.ortvalue_from_numpy(zeros, "cuda", 0))
    for spec in session.get_outputs():
        binding.bind_ortvalue_output(spec.name, ort.OrtValue.ortvalue_from_shape_and_type(spec.shape, np.float32,
                                                                                           "cuda", 0))
    return lambda: session.run_with_iobinding(binding)


def runner(folder: Path, batch: int, device: str, cuda_graphs: bool = False, pinned: bool = True):
    """The service's Runner (numpy in, outputs copied back), each batch first gathered into its host buffer as
    the service gathers its requests' images (page-locked on CUDA; `pinned=False`: fresh pageable memory, as before
    Runner.host_batch); `cuda_graphs`: with `batch` replayed as a CUDA graph, as VITSERVE_CUDA_GRAPH_MAX_BATCH
    does."""
    entry = read_entry(folder)
    h, w = entry.policy.size
    inputs = (entry.manifest["input"]["name"], entry.manifest["tensor_input"]["name"])
    run = Runner(entry.path(), inputs, [device], cuda_graph_max_batch=batch if cuda_graphs else 0)
    if cuda_graphs and batch not in run.graphs:  # graphs come in powers of two; another batch would run plainly
        raise RuntimeError(f"no CUDA graph for batch {batch} (one per power of two; a failed capture is logged)")
    images, tensors = np.zeros((batch, h, w, 3), np.uint8), np.zeros((0, 3, h, w), np.float32)
    empty = run.host_batch if pinned else lambda n: np.empty((n, h, w, 3), np.uint8)

    def call() -> None:
        gathered = empty(batch)
        np.copyto(gathered, images)
        run.run(gathered, tensors)

    return call


def runner_threads(folder: Path, batch: int, sessions: int):
    """The service's inference on a GPU: two threads each gathering and running a batch at the same time, over
    one Runner, as the service does, or (`sessions=2`) over one each: the other session's own CUDA stream may
    let one batch's copies overlap the other's kernels."""
    calls = [runner(folder, batch, CUDA) for _ in range(sessions)]
    pool = ThreadPoolExecutor(2)

    def call() -> int:
        for future in [pool.submit(calls[i % sessions]) for i in range(2)]:
            future.result()
        return 2 * batch

    return call


def torch_model(model: str, batch: int, cuda: bool, compiled: bool = False):
    import torch

    from models import create_model
    net = create_model(model).eval()
    size = net.spec.img_size
    x = torch.randn(batch, 3, size, size)
    if cuda:
        net, x = net.half().cuda(), x.half().cuda()
    if compiled:
        net = torch.compile(net)  # compiles at the first call, which median_rates leaves out

    def run() -> None:
        with torch.inference_mode():
            net(x)
        if cuda:
            torch.cuda.synchronize()

    return run


def timm_amp(model: str, batch: int):
    import timm
    import torch
    if not timm.is_model(model):
        raise RuntimeError("timm has no such model")
    net = timm.create_model(model).eval().cuda().to(memory_format=torch.channels_last)
    size = net.pretrained_cfg["input_size"][-1]
    x = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=torch.channels_last)

    def run() -> None:
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
            net(x)
        torch.cuda.synchronize()

    return run


def graphs(models: list[str], batches: list[int], cache: Path, cuda: bool, rounds: int, seconds: float,
           sdpa_kernels: list[str], ablate: list[str]) -> dict:
    try:
        import timm  # noqa: F401
        has_timm = cuda
    except ImportError:
        has_timm = False
        skipped.append("timm AMP: timm does not import here")
    pinned = cuda and pinned_empty() is not None
    if cuda and not pinned:
        skipped.append("Runner fp16 pageable: CuPy cannot allocate page-locked memory here, so the Runner's batches "
                       "are pageable too")
    raw = {}
    print(f"\ngraphs: images/s, medians of {rounds} rounds" + ("" if cuda else " (no CUDA: CPU, fp32)"))
    for model in models:
        fp32 = export(cache, model)
        fp16 = export(cache, model, "fp16") if cuda else None
        for batch in batches:
            if cuda:
                calls = {"ORT fp32 dev": ort_on_device(fp32, batch), "ORT fp16 dev": ort_on_device(fp16, batch),
                         "ORT fp16 unfused dev": ort_on_device(fp16, batch,
                                                               fp16_variant(cache, model, tuple(REWRITES))),
                         "Runner fp16": runner(fp16, batch, CUDA),
                         "Runner fp16 2 threads": runner_threads(fp16, batch, 1),
                         "Runner fp16 2 threads 2 sessions": runner_threads(fp16, batch, 2),
                         "torch fp16": torch_model(model, batch, True)}
                if pinned:
                    calls["Runner fp16 pageable"] = runner(fp16, batch, CUDA, pinned=False)
                calls.update({f"ORT fp16 without {r}": ort_on_device(fp16, batch, fp16_variant(cache, model, (r,)))
                              for r in ablate})
                # each built and run a few times here, where a failure is named, not fatal: torch.compile compiles
                # at its first call, and ORT captures a CUDA graph only after one or two plain runs
                optional = {"torch.compile fp16": lambda: torch_model(model, batch, True, compiled=True)}
                optional.update({f"ORT fp16 dev, sdpa {k}": lambda v=v: ort_on_device(fp16, batch, sdpa_kernel=v)
                                 for k, v in SDPA_KERNELS.items() if k in sdpa_kernels})
                if batch <= CUDA_GRAPH_MAX_BATCH:
                    optional["ORT fp16 CUDA graph"] = lambda: cuda_graph_on_device(model, batch, cache)
                    optional["Runner fp16 CUDA graph"] = lambda: runner(fp16, batch, CUDA, cuda_graphs=True)
                if has_timm:
                    optional["timm AMP"] = lambda: timm_amp(model, batch)
                for name, make in optional.items():
                    try:
                        calls[name] = make()
                        for _ in range(3):
                            calls[name]()
                    except Exception as e:  # ONNX Runtime's errors derive from Exception alone
                        calls.pop(name, None)
                        skipped.append(f"{name}, {model} batch {batch}: {e}")
            else:
                calls = {"ORT fp32": runner(fp32, batch, CPU), "torch fp32": torch_model(model, batch, False)}
            rates = median_rates(calls, batch, rounds, seconds)
            raw[model, batch] = rates["ORT fp16 dev" if cuda else "ORT fp32"]
            against = (["torch fp16", "torch.compile fp16", "ORT fp16 unfused dev"] if cuda else ["torch fp32"])
            ratios = ", ".join(f"ORT {'fp16' if cuda else 'fp32'} / {k} {raw[model, batch] / rates[k]:.2f}"
                               for k in against if k in rates)
            print(f"{model:<30} batch {batch:>4}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items())
                  + f"; {ratios}", flush=True)
    return raw


def service(model: str, cache: Path, cuda: bool, clients: list[int], seconds: float, raw: dict,
            max_batch: int, cuda_graph_max_batch: int) -> None:
    folders = [export(cache, model)] + ([export(cache, model, "fp16")] if cuda else [])
    processes = max(1, min(8, (os.cpu_count() or 2) // 2))
    photo = [("chelsea.jpg", jpeg((451, 300)))]
    entry = read_entry(folders[0])
    pixels = model_input(decode(photo[0][1], None, 10**9).image, entry.policy)
    routes = {"/classify, 1 JPEG": ((classify_requests, (photo, {"model": model, "top_k": 1}, 1)), 1),
              "/classify, 8 JPEGs": ((classify_requests, (photo, {"model": model, "top_k": 1}, 8)), 8),
              "/v2 FP32": ((v2_requests, (model, entry.manifest["tensor_input"]["name"],
                                          entry.policy.normalise(pixels[None]))), 1),
              "/v2 UINT8": ((v2_requests, (model, entry.manifest["input"]["name"], pixels[None])), 1)}
    reference = raw.get((model, max_batch))
    print(f"\nservice: {model}, max batch {max_batch}, clients over {processes} processes; service / raw = images/s "
          f"over the raw session's at batch {max_batch} ({f'{reference:,.0f}' if reference else 'not measured'})")
    settings = {"max_batch_size": max_batch, "queue_limit": 64 * max_batch,
                "cuda_graph_max_batch": cuda_graph_max_batch, "max_files": 64}
    with repository_of(folders) as repo, running_service(model_repository=repo, **settings) as url:
        for name, (sender, files) in routes.items():
            for c in clients:
                r = run_level_processes(url, sender, c, seconds, processes, files_per_request=files)
                share = f"{r.images_per_s / reference:.0%}" if reference else "-"
                lat = r.latency_ms or {"p50": float("nan"), "p99": float("nan")}
                print(f"{name:<20} {c:>4} clients: {r.images_per_s:>9,.0f} images/s ({share} of raw), p50 "
                      f"{lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, client {r.client_cores:.2f} cores"
                      + (", CLIENT-BOUND" if r.client_bound else "") + (f", failures {r.failures}" if r.failures
                                                                        else ""), flush=True)


@contextmanager
def repository_of(folders: list[Path]) -> Iterator[Path]:
    """A temporary repository of these model folders alone (links): the cache's other models would load and warm
    up too."""
    with tempfile.TemporaryDirectory() as repo:
        for folder in folders:
            (Path(repo) / folder.name).symlink_to(folder.resolve())
        yield Path(repo)


@cache
def decoding(cuda: bool, policy: InputPolicy, copies: int = 512) -> None:
    """Images/s into the model's input: the CPU path on every core against GpuDecoder (the JPEG engines first), in
    batches from one and two threads (the inference threads), for the 451 x 300 photo, the 12 MP one and a mix of
    sizes; and whether the JPEG engines alone decode with and without fancy upsampling (nvImageCodec's option, which
    applies to every decoder: one they refuse goes to the CUDA kernels)."""
    threads = os.cpu_count() or 1
    print(f"\ndecode: images/s into the {policy.size[0]} px input, {copies} images; GPU: batch/threads")
    sets = {"451x300 JPEG": [jpeg((451, 300))], "12 MP phone JPEG": [phone_photo()],
            "mixed sizes (" + ", ".join(f"{w}x{h}" for w, h in MIXED) + ")": [jpeg(size) for size in MIXED]}
    for label, datas in sets.items():
        batch = [datas[i % len(datas)] for i in range(copies)]
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(partial(cpu_input, policy=policy), batch))
            cpu = copies / (time.perf_counter() - start)
        line = f"{label}: the CPU path (upload_input) on {threads} threads {cpu:,.0f}"
        if cuda and (decoder := gpu_decoder(policy)):
            line += "; GpuDecoder " + ", ".join(f"{size}/{n} {gpu_decode_rate(decoder, datas, copies, size, n):,.0f}"
                                                for size, n in ((1, 1), (16, 2), (64, 2)))
            line += f"; its nvImageCodec decode alone 64/2 {gpu_decode_rate(decoder, datas, copies, 64, 2, True):,.0f}"
        print(line, flush=True)
    if cuda:
        print(engines_alone(jpeg((451, 300))), flush=True)


def engines_alone(data: bytes, n: int = 16) -> str:
    from nvidia import nvimgcodec
    counts = []
    for options in (":fancy_upsampling=1", ""):
        decoder = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(nvimgcodec.HW_GPU_ONLY)], options=options)
        counts.append(sum(image is not None for image in decoder.decode([data] * n)))
    return (f"the JPEG engines alone (HW_GPU_ONLY) decoded {counts[0]} of {n} baseline JPEGs with fancy upsampling, "
            f"{counts[1]} without")


def cpu_input(data: bytes, policy: InputPolicy) -> np.ndarray:
    """The service's CPU path: the JPEG decoded reduced (draft), the crop warped out of it."""
    return upload_input(data, policy, 10**9)


def gpu_decoder(policy: InputPolicy):
    try:
        from service.images.gpu_decode import GpuDecoder
        return GpuDecoder(policy, max_batch=64)
    except (ImportError, RuntimeError) as e:
        skipped.append(f"nvImageCodec decoding: {e}")
        return None


def gpu_decode_rate(decoder, datas: list[bytes], copies: int, batch: int, threads: int,
                    alone: bool = False) -> float:
    """Images/s of `decoder` on batches of `batch` of the JPEGs (in turn), from `threads` threads at once (the
    service's inference threads: 2 on a GPU), after one warm-up batch in each; `alone`: its thread's nvImageCodec
    decoder alone, to the decoded images on the device (no resize), synchronised."""
    fallback = partial(cpu_input, policy=decoder.policy)
    jpegs = [datas[i % len(datas)] for i in range(batch)]

    def run(rounds: int) -> None:
        for _ in range(rounds):
            if alone:
                stream = decoder._stream()
                decoder.local.decoder.decode(jpegs, params=decoder.params, cuda_stream=stream.ptr)
                stream.synchronize()
            else:
                decoder.decode(jpegs, fallback)

    rounds = max(1, copies // batch // threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, [1] * threads))
        start = time.perf_counter()
        list(pool.map(run, [rounds] * threads))
    return rounds * threads * batch / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", help="default: DeiT-Ti, DeiT-S, ViT-B/16, Swin-T on CUDA; DeiT-Ti on CPU")
    p.add_argument("--batches", nargs="+", type=int, help="default: 1 64 256 on CUDA, 1 16 on CPU")
    p.add_argument("--clients", nargs="+", type=int, default=[64, 256])
    parts = ["graphs", "service", "decode"]
    p.add_argument("--parts", nargs="+", choices=parts, default=parts)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=5.0, help="per round (graphs) or level (service)")
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench" / "gpu")
    p.add_argument("--sdpa-kernels", nargs="+", choices=SDPA_KERNELS, default=[],
                   help="graphs: also ORT fp16 dev with this attention kernel forced (the CUDA provider's sdpa_kernel)")
    p.add_argument("--ablate", nargs="*", choices=list(REWRITES), metavar="REWRITE",
                   help="graphs: also the fp16 graph without each of export/fusion.py's rewrites named (none named: "
                        "all of them), one at a time")
    p.add_argument("--cuda-graph-max-batch", type=int, default=0,
                   help="service: VITSERVE_CUDA_GRAPH_MAX_BATCH (small batches replayed as CUDA graphs)")
    args = p.parse_args()
    refill_all(args.cache)  # graphs staged without their weights (python bench/gpu_check.py --export-cache)
    probe = export(args.cache, (args.models or ["deit_tiny_patch16_224"])[0])
    cuda = choose_device([read_entry(probe)], None) == CUDA
    if not cuda:
        skipped.append("everything on CUDA (fp16 graphs, ORT on device, torch fp16, timm AMP, nvImageCodec): "
                       "the CUDA provider does not start here")
    models = args.models or (CUDA_MODELS if cuda else ["deit_tiny_patch16_224"])
    batches = args.batches or ([1, 64, 256] if cuda else [1, 16])
    device = gpu_name() if cuda else f"no usable GPU, {os.cpu_count()} CPU cores"
    print(f"bench/gpu.py on {device}; onnxruntime {ort.__version__}")
    ablate = [] if args.ablate is None else args.ablate or list(REWRITES)
    raw = (graphs(models, batches, args.cache, cuda, args.rounds, args.seconds, args.sdpa_kernels, ablate)
           if "graphs" in args.parts else {})
    if "service" in args.parts:
        service(models[0], args.cache, cuda, args.clients, args.seconds, raw, max(batches), args.cuda_graph_max_batch)
    if "decode" in args.parts:
        decoding(cuda, read_entry(probe).policy)
    for line in skipped:
        print(f"skipped: {line}")


def gpu_name() -> str:
    import subprocess
    return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    try:
        main()
    except MissingGraph as e:
        sys.exit(f"bench/gpu.py: {e}")
