"""Which runtime and precision run a model on a CPU host.

A model's export verifies its plans (the manifest's `plans`: ONNX Runtime or OpenVINO, fp32, bf16 or int8, each
through the export's accuracy gate against fp32; `python -m export ... --precision auto`). At load the service
measures those this host can run, interleaved and briefly, on the batch sizes it will run (1 and the model's
max_batch_size), and keeps the fastest: by measurement, not by rule, since each runtime is faster for some models and
CPUs and slower for others (docs/performance.md#cpu-plans). VITSERVE_CPU_PLAN pins one instead. An export without
plans runs as before: ONNX Runtime, the precision of its graph.
"""
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from repository import ModelEntry, verify_file
from service.core.errors import BadInput

from . import openvino_runtime
from .openvino_runtime import OpenVinoRunner
from .runtime import CPU, Runner

ONNXRUNTIME, OPENVINO = "onnxruntime", "openvino"
AUTO, FIRST = "auto", "first"
ROUNDS, BLOCK_S = 3, 0.05  # interleaved rounds, each a block of runs at least this long per plan and batch size


@dataclass(frozen=True)
class CpuPlan:
    runtime: str  # ONNXRUNTIME or OPENVINO
    precision: str  # fp32, bf16 or int8
    file: str = "model"  # the manifest's name of the graph it runs (files: model, model_int8)

    @property
    def name(self) -> str:
        return f"{self.runtime}:{self.precision}"


@dataclass
class Choice:
    """The plan that runs a model, its open runner, why it was chosen, and what was measured (images/s by plan
    name and batch size)."""
    plan: CpuPlan
    runner: Runner | OpenVinoRunner
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
                iobinding: bool) -> Runner | OpenVinoRunner:
    """A runner of the graph at `path` on the CPU, in the plan's runtime and precision."""
    if plan.runtime == OPENVINO:
        return OpenVinoRunner(path, inputs, plan.precision, threads)
    return Runner(path, inputs, [CPU], threads, spin_wait, iobinding=iobinding)


def choose(entry: ModelEntry, inputs: tuple[str, str], batches: list[int], pinned: str, threads: int = 0,
           spin_wait: bool = False, iobinding: bool = False) -> Choice:
    """The plan that runs the model here, opened: `pinned` (VITSERVE_CPU_PLAN: RUNTIME:PRECISION; first: the first
    of the verified plans this host runs, unmeasured), else the fastest of those, by its images/s at the batch sizes
    given (their geometric mean).
    BadInput, naming what the export verified, where the pinned plan is not among them or cannot run here."""
    plans = verified(entry)

    def opened(plan: CpuPlan) -> Runner | OpenVinoRunner:  # (the model's own graph was checked as it was read)
        path = entry.path() if plan.file == "model" else verify_file(entry, plan.file)
        return open_runner(path, inputs, plan, threads, spin_wait, iobinding)

    if pinned not in (AUTO, FIRST):
        plan = next((p for p in plans if p.name == pinned), None)
        if plan is None:
            refused = "".join(f"; {r['runtime']}:{r['precision']} failed its gate: {r['reason']}"
                              for r in entry.manifest.get("plans_refused", []))
            raise BadInput(f"VITSERVE_CPU_PLAN={pinned}: {entry.key}'s export verified "
                           f"{', '.join(p.name for p in plans)}{refused}")
        if (why := why_not(plan)) is not None:
            raise BadInput(f"VITSERVE_CPU_PLAN={pinned}: {why}")
        return Choice(plan, opened(plan), "pinned (VITSERVE_CPU_PLAN)")
    runnable = [p for p in plans if why_not(p) is None]
    if not runnable:
        raise BadInput(f"{entry.key}: this host runs none of the plans its export verified: "
                       + "; ".join(f"{p.name}: {why_not(p)}" for p in plans))
    if len(runnable) == 1 or pinned == FIRST:
        return Choice(runnable[0], opened(runnable[0]), "the only plan this host runs" if len(runnable) == 1 else
                      "the first of its export's plans this host runs (VITSERVE_CPU_PLAN=first: not measured)")
    runners = {plan: opened(plan) for plan in runnable}
    measured = measure(runners, entry.policy.size, batches)
    score = {plan: math.exp(statistics.fmean(math.log(measured[plan.name][str(b)]) for b in batches))
             for plan in runnable}
    best = max(runnable, key=score.get)
    return Choice(best, runners[best], f"the fastest here of {len(runnable)} verified plans", measured)


def measure(runners: dict[CpuPlan, Runner | OpenVinoRunner], size: tuple[int, int], batches: list[int]
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
