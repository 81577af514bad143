"""The CPU plans (service/engine/cpu_plans.py) on both runtimes, ONNX Runtime and OpenVINO: each plan of the embedded
shapes-deit's export, pinned, answers as its fp32 graph does within the plan's gate, and draws attention maps; auto
measures them and runs the fastest by its own figures, under the process backend too (its status crosses to the
workers); a pinned plan the export did not verify, or whose gate failed, is refused by name."""
import asyncio
import io
import json
import math
import shutil
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from service_process import ROOT, running_service

from models.synthetic import sample_rng
from models.synthetic.shapes import render_shape
from repository import graph_inputs, read_entry
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.engine.backends.local import LocalBackend
from service.engine.cpu_plans import verified, why_not
from service.http.app import create_app

MODEL = "shapes-deit"
SOURCE = ROOT / "model_repository" / MODEL
# 32 synthetic shapes of the demo's kind, not its training images: what each plan is held against
SHAPES = [render_shape(sample_rng(1, i), 96, label=i % 6).image for i in range(32)]


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


UPLOADS = [("files", (f"{i}.png", png(image))) for i, image in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def fp32_top1() -> np.ndarray:
    session = ort.InferenceSession(SOURCE / "model.onnx", providers=["CPUExecutionProvider"])
    return session.run(["logits"], graph_inputs(np.stack([np.asarray(s) for s in SHAPES])))[0].argmax(1)


def repository(root: Path, **changes) -> Path:
    """A repository of shapes-deit alone (its manifest changed by `changes`)."""
    shutil.copytree(SOURCE, root / MODEL)
    manifest = {**json.loads((SOURCE / "manifest.json").read_text()), **changes}
    (root / MODEL / "manifest.json").write_text(json.dumps(manifest))
    return root


async def served(settings: Settings, requests: list[tuple[str, str, dict]]) -> list[httpx.Response]:
    """Each request through the app in this process, start-up (the plans measured or pinned) included."""
    app = create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics())
    async with app.router.lifespan_context(app):
        await app.state.pipelines.backend.loaded()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vitserve") as client:
            return [await client.request(method, path, **kw) for method, path, kw in requests]


def test_the_export_verified_every_plan_and_this_host_runs_them_on_both_runtimes():
    plans = {plan.name for plan in verified(read_entry(SOURCE))}
    assert plans == {"onnxruntime:fp32", "onnxruntime:int8", "openvino:fp32", "openvino:bf16", "openvino:int8"}
    assert why_not(next(p for p in verified(read_entry(SOURCE)) if p.name == "openvino:fp32")) is None


@pytest.mark.parametrize("plan", [p.name for p in verified(read_entry(SOURCE)) if why_not(p) is None])
def test_a_pinned_plan_answers_as_fp32_within_its_gate_and_draws_attention_maps(plan, tmp_path, fp32_top1):
    """Its attention maps: the last block's, from the graph the plan runs, and rollout's, from the explain graph in
    the plan's runtime."""
    settings = Settings(model_repository=repository(tmp_path), warmup_runs=0, cpu_plan=plan)
    models, classified, *drawn = asyncio.run(served(settings, [
        ("GET", "/models", {}), ("POST", "/classify", {"files": UPLOADS, "params": {"top_k": 1}}),
        *(("POST", "/attention-map", {"files": {"file": UPLOADS[0][1]}, "params": {"method": method}})
          for method in ("last", "rollout"))]))
    (info,) = models.json()["models"]
    assert (info["plan"], info["plan_reason"], info["precision"]) == (plan, "pinned (VITSERVE_CPU_PLAN)",
                                                                      plan.split(":")[1])
    labels = json.loads((SOURCE / "manifest.json").read_text())["labels"]
    top1 = np.array([labels.index(r["predictions"][0]["label"]) for r in classified.json()["results"]])
    assert (top1 == fp32_top1).sum() >= len(SHAPES) - 1, plan  # the export's gate: >= 99% of 1,200
    assert all(r.status_code == 200 and r.content.startswith(b"\x89PNG") for r in drawn), plan


def test_auto_runs_the_fastest_plan_it_measured_under_the_process_backend_too(tmp_path):
    with running_service(model_repository=repository(tmp_path), backend="process", workers=1,
                         cpu_plan="auto") as url:
        (info,) = httpx.get(f"{url}/models", timeout=30).json()["models"]
        config = httpx.get(f"{url}/v2/models/{MODEL}/config", timeout=30).json()
    measured = info["plan_measured"]
    runnable = {p.name for p in verified(read_entry(SOURCE)) if why_not(p) is None}
    assert set(measured) == runnable and all(set(rates) == {"1", "16"} for rates in measured.values())
    score = {plan: math.sqrt(rates["1"] * rates["16"]) for plan, rates in measured.items()}
    assert info["plan"] == max(score, key=score.get) and info["plan_reason"].startswith("the fastest here")
    assert config["parameters"]["plan"] == {"string_value": info["plan"]}


def test_a_pinned_plan_the_export_did_not_verify_is_refused_saying_what_it_did(tmp_path):
    manifest = json.loads((SOURCE / "manifest.json").read_text())
    kept = [p for p in manifest["plans"] if (p["runtime"], p["precision"]) != ("openvino", "bf16")]
    failed = {"runtime": "openvino", "precision": "bf16", "reason": "top-1 agreement 0.970 on held-out data"}
    settings = Settings(model_repository=repository(tmp_path, plans=kept, plans_refused=[failed]), warmup_runs=0,
                        cpu_plan="openvino:bf16")
    models, classified = asyncio.run(served(settings, [("GET", "/models", {}),
                                                       ("POST", "/classify", {"files": UPLOADS[:1]})]))
    (info,) = models.json()["models"]
    assert not info["ready"] and "VITSERVE_CPU_PLAN=openvino:bf16" in info["error"]
    assert "onnxruntime:fp32" in info["error"] and "openvino:bf16 failed its gate: top-1 agreement 0.970" in info[
        "error"]
    assert classified.status_code == 503 and classified.json()["error"]["code"] == "model_unavailable"
