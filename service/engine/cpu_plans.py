"""Which runtime and precision run a model on a CPU host.

A model's export verifies its plans (the manifest's `plans`: ONNX Runtime or OpenVINO, fp32, bf16 or int8, each
through the export's accuracy gate against fp32; `python -m export ... --precision auto`). The first start on a host
measures those this host can run, interleaved and briefly, on the batch sizes it will run (1 and the model's
max_batch_size), and runs the fastest, unless a plan of higher precision is within MARGIN of it: by measurement, not
by rule, since each runtime is faster for some models and CPUs and slower for others (docs/performance.md#cpu-plans).
The choice is kept on disk (kept_plans.py), so that every later start, process and replica on the host runs the same
plan without measuring again. VITSERVE_CPU_PLAN pins one instead, for every model or per model. An export without
plans runs as before: ONNX Runtime, the precision of its graph.

Every plan answers an image as it would alone: dynamic int8 quantizes each batch tensor with one scale, so that an
image's answer would move with its batchmates (by up to 0.034 in the logits), and it runs its images one at a time
(PerImage).
"""
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from repository import ModelEntry, verify_file
from service.core.errors import BadInput

from . import kept_plans, openvino_runtime
from .openvino_runtime import OpenVinoRunner
from .runtime import CPU, Runner

ONNXRUNTIME, OPENVINO = "onnxruntime", "openvino"
AUTO, FIRST, MEASURE = "auto", "first", "measure"
ROUNDS, BLOCK_S = 3, 0.05  # interleaved rounds, each a block of runs at least this long per plan and batch size
# a plan of lower precision runs only where it is this much faster than one of higher precision: within it, two
# measurements of one plan differ as much (docs/performance.md#cpu-plans)
MARGIN = 1.10
PRECISIONS = ("fp32", "bf16", "int8")  # highest first


@dataclass(frozen=True)
class CpuPlan:
    runtime: str  # ONNXRUNTIME or OPENVINO
    precision: str  # fp32, bf16 or int8
    file: str = "model"  # the manifest's name of the graph it runs (files: model, model_int8)

    @property
    def name(self) -> str:
        return f"{self.runtime}:{self.precision}"

    @property
    def batch_invariant(self) -> bool:
        """Whether a batch's images are computed each as it would be alone: not dynamic int8's (one quantization
        scale per batch tensor), which therefore runs its images one at a time (PerImage)."""
        return self.precision != "int8"


class PerImage:
    """A runner whose graph answers an image otherwise beside other images, run one image at a time: each image's
    answer is its own. Everything else is the runner's (provider, host_batch, ...)."""

    def __init__(self, runner: "Runner | OpenVinoRunner"):
        self.runner = runner

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def run(self, images: np.ndarray, tensors: np.ndarray) -> dict[str, np.ndarray]:
        if len(images) + len(tensors) <= 1:
            return self.runner.run(images, tensors)
        runs = ([self.runner.run(images[i:i + 1], tensors[:0]) for i in range(len(images))]
                + [self.runner.run(images[:0], tensors[i:i + 1]) for i in range(len(tensors))])
        return {name: np.concatenate([out[name] for out in runs]) for name in runs[0]}


@dataclass
class Choice:
    """The plan that runs a model, its open runner, why it was chosen, and what was measured (images/s by plan
    name and batch size)."""
    plan: CpuPlan
    runner: Runner | OpenVinoRunner | PerImage
    reason: str
    measured: dict[str, dict[str, float]] = field(default_factory=dict)


def verified(entry: ModelEntry) -> list[CpuPlan]:
    """The plans the model's export verified; without any, ONNX Runtime on its graph at its own precision."""
    return [CpuPlan(p["runtime"], p["precision"], p["file"]) for p in entry.manifest.get("plans", [])] or [
        CpuPlan(ONNXRUNTIME, entry.precision)]


def why_not(plan: CpuPlan) -> str | None:
    """Why this host cannot run the plan; None where it can."""
    if plan.runtime == OPENVINO and not openvino_runtime.available():
        return "OpenVINO is not installed (pip install '.[openvino]')"
    if plan.precision == "bf16" and "BF16" not in openvino_runtime.capabilities():
        return "this CPU computes no bf16 (it has neither AVX512_BF16 nor AMX)"
    return None


def open_runner(path: Path, inputs: tuple[str, str], plan: CpuPlan, threads: int, spin_wait: bool,
                iobinding: bool) -> Runner | OpenVinoRunner | PerImage:
    """A runner of the graph at `path` on the CPU, in the plan's runtime and precision, one image at a time where the
    plan is not batch-invariant."""
    if plan.runtime == OPENVINO:
        runner = OpenVinoRunner(path, inputs, plan.precision, threads)
    else:
        runner = Runner(path, inputs, [CPU], threads, spin_wait, iobinding=iobinding)
    return runner if plan.batch_invariant else PerImage(runner)


def model_spec(setting: str, model: str) -> tuple[str, bool]:
    """A model's part of VITSERVE_CPU_PLAN ("auto", "NAME=RUNTIME:PRECISION,...,RUNTIME:PRECISION", ...) and
    whether it names the model: its own NAME=SPEC, else the bare one for every model, else auto."""
    specs = dict(part.split("=", 1) if "=" in part else ("", part) for part in setting.split(","))
    return (specs[model], True) if model in specs else (specs.get("", AUTO), False)


def pick(scores: dict[CpuPlan, float]) -> tuple[CpuPlan, str]:
    """The plan to run by its images/s: the fastest, unless one of higher precision is within MARGIN of it (then the
    fastest of the highest precision within it); and why."""
    fastest = max(scores, key=scores.get)
    near = [p for p in scores if scores[p] * MARGIN >= scores[fastest]]
    best = min(near, key=lambda p: (PRECISIONS.index(p.precision), -scores[p]))
    if best == fastest:
        return best, f"the fastest here of {len(scores)} verified plans"
    return best, (f"within {MARGIN - 1:.0%} of the fastest here ({fastest.name}, {scores[fastest]:,.0f} against "
                  f"{scores[best]:,.0f} images/s), at a higher precision")


def choose(entry: ModelEntry, inputs: tuple[str, str], batches: list[int], setting: str, threads: int = 0,
           spin_wait: bool = False, iobinding: bool = False, keep_in: Path | None = None,
           measure_now: bool = True) -> Choice:
    """The plan that runs the model here, opened, by the model's part of `setting` (VITSERVE_CPU_PLAN, model_spec):
    a plan pinned for it (RUNTIME:PRECISION); first, the first of the verified plans this host runs, unmeasured;
    auto, the one kept in `keep_in` for this host and graph (kept_plans.py), else the pick of a measurement at the
    batch sizes given (their geometric mean), kept there; measure, a measurement whatever is kept. Without
    `measure_now` (a graph loaded while others serve: no measurement beside live batches) auto takes the kept plan,
    else the first. A plan pinned for every model runs only those whose export verified it; the others take auto.
    BadInput, naming what the export verified, where a plan pinned for this model is not among them or cannot run
    here."""
    plans = verified(entry)
    spec, named = model_spec(setting, entry.name)
    source = f"VITSERVE_CPU_PLAN={setting}"

    def opened(plan: CpuPlan) -> Runner | OpenVinoRunner | PerImage:  # (the model's own graph was checked as read)
        path = entry.path() if plan.file == "model" else verify_file(entry, plan.file)
        return open_runner(path, inputs, plan, threads, spin_wait, iobinding)

    note = ""
    if spec not in (AUTO, FIRST, MEASURE):
        plan = next((p for p in plans if p.name == spec), None)
        why = "its export did not verify it" if plan is None else why_not(plan)
        if why is None:
            return Choice(plan, opened(plan), f"pinned ({source})")
        if named:
            refused = "".join(f"; {r['runtime']}:{r['precision']} failed its gate: {r['reason']}"
                              for r in entry.manifest.get("plans_refused", []))
            raise BadInput(f"{source}: {entry.key}: {why}; its export verified "
                           f"{', '.join(p.name for p in plans)}{refused}")
        spec, note = AUTO, f" ({source} is not for it: {why})"
    runnable = [p for p in plans if why_not(p) is None]
    if not runnable:
        raise BadInput(f"{entry.key}: this host runs none of the plans its export verified: "
                       + "; ".join(f"{p.name}: {why_not(p)}" for p in plans))
    if len(runnable) == 1 or spec == FIRST:
        return Choice(runnable[0], opened(runnable[0]), ("the only plan this host runs" if len(runnable) == 1 else
                      f"the first of its export's plans this host runs ({source}: not measured)") + note)
    key = kept_plans.plan_key(entry, threads or len(os.sched_getaffinity(0)), batches)
    if spec == AUTO and keep_in is not None and (record := kept_plans.kept(keep_in, key)) is not None:
        plan = next((p for p in runnable if p.name == record["plan"]), None)
        if plan is not None:
            return Choice(plan, opened(plan), f"measured before on this host and kept ({keep_in}){note}",
                          record["measured"])
    if not measure_now:
        return Choice(runnable[0], opened(runnable[0]), "the first of its export's plans this host runs: loaded while "
                      f"others serve, not measured beside their batches (the next start measures it){note}")
    runners = {plan: opened(plan) for plan in runnable}
    measured = measure(runners, entry.policy.size, batches)
    best, why = pick({plan: math.exp(statistics.fmean(math.log(measured[plan.name][str(b)]) for b in batches))
                      for plan in runnable})
    if keep_in is not None and (unkept := kept_plans.keep(keep_in, key, best.name, measured)) is not None:
        note += f" (not kept in {keep_in}, {unkept}: each start measures)"
    return Choice(best, runners[best], why + note, measured)


def measure(runners: dict[CpuPlan, Runner | OpenVinoRunner | PerImage], size: tuple[int, int], batches: list[int]
            ) -> dict[str, dict[str, float]]:
    """Images/s of each runner at each batch size: the median of ROUNDS interleaved rounds (so that the host's noise
    falls on every plan alike), each a block of runs at least BLOCK_S long, after one run to warm up."""
    h, w = size
    no_tensors = np.zeros((0, 3, h, w), np.float32)
    images = {b: np.random.default_rng(b).integers(0, 256, (b, h, w, 3), dtype=np.uint8) for b in batches}
    runs, samples = {}, {(plan, b): [] for plan in runners for b in batches}
    for plan, runner in runners.items():
        for b in batches:
            start = time.perf_counter()
            runner.run(images[b], no_tensors)
            runs[plan, b] = max(1, math.ceil(BLOCK_S / max(time.perf_counter() - start, 1e-6)))
    for _ in range(ROUNDS):
        for plan, runner in runners.items():
            for b in batches:
                start = time.perf_counter()
                for _ in range(runs[plan, b]):
                    runner.run(images[b], no_tensors)
                samples[plan, b].append(b * runs[plan, b] / (time.perf_counter() - start))
    return {plan.name: {str(b): round(statistics.median(samples[plan, b]), 1) for b in batches} for plan in runners}
