"""The CPU plans (service/engine/cpu_plans.py) on both runtimes, ONNX Runtime and OpenVINO: each plan of the embedded
shapes-deit's export, pinned, answers as its fp32 graph does within the plan's gate, answers an image as it would
alone at any batch, and draws attention maps; auto measures them once per host and graph, runs the pick of its own
figures and keeps it, which a restarted inference process reuses; a plan pinned for a model whose export did not
verify it, or whose gate failed, is refused by name, and one pinned for every model runs where it was verified; every
answer names its plan."""
import asyncio
import io
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from pydantic import ValidationError
from service_process import ROOT, model_pixels, photo_bytes, role_pids, service_and_process

from models.synthetic import sample_rng
from models.synthetic.shapes import render_shape
from repository import graph_inputs, read_entry
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.engine.backends.local import LocalBackend
from service.engine import cpu_plans
from service.engine.backends.lifecycle import input_names
from service.engine.cpu_plans import CpuPlan, choose, model_spec, pick, verified, why_not
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


def runnable(plan: str) -> CpuPlan:
    """The export's plan of that name; a skip, saying why, where this host cannot run it (bf16 on a CPU without)."""
    found = next(p for p in verified(read_entry(SOURCE)) if p.name == plan)
    if (why := why_not(found)) is not None:
        pytest.skip(f"{plan}: {why}")
    return found


PLANS = [p.name for p in verified(read_entry(SOURCE))]


@pytest.mark.parametrize("plan", PLANS)
def test_a_pinned_plan_answers_as_fp32_within_its_gate_and_draws_attention_maps(plan, tmp_path, fp32_top1):
    """Its attention maps: the last block's, from the graph the plan runs, and rollout's, from the explain graph in
    the plan's runtime."""
    runnable(plan)
    settings = Settings(model_repository=repository(tmp_path), warmup_runs=0, cpu_plan=plan)
    models, classified, *drawn = asyncio.run(served(settings, [
        ("GET", "/models", {}), ("POST", "/classify", {"files": UPLOADS, "params": {"top_k": 1}}),
        *(("POST", "/attention-map", {"files": {"file": UPLOADS[0][1]}, "params": {"method": method}})
          for method in ("last", "rollout"))]))
    (info,) = models.json()["models"]
    assert (info["plan"], info["precision"]) == (plan, plan.split(":")[1])
    assert info["plan_reason"].startswith(f"pinned (VITSERVE_CPU_PLAN={plan})")
    assert classified.json()["plan"] == plan
    labels = json.loads((SOURCE / "manifest.json").read_text())["labels"]
    top1 = np.array([labels.index(r["predictions"][0]["label"]) for r in classified.json()["results"]])
    assert (top1 == fp32_top1).sum() >= len(SHAPES) - 1, plan  # the export's gate: >= 99% of 1,200
    assert all(r.status_code == 200 and r.content.startswith(b"\x89PNG") for r in drawn), plan


def test_auto_runs_its_pick_of_what_it_measured_and_a_restarted_inference_process_reuses_it(tmp_path):
    """Under the process backend (the status crosses to the workers): measured at the first start, kept in
    VITSERVE_CPU_PLAN_DIR, and the inference process that replaces a killed one runs the same plan unmeasured."""
    with service_and_process(model_repository=repository(tmp_path / "repository"), backend="process", workers=1,
                             cpu_plan="auto", cpu_plan_dir=tmp_path / "plans") as (url, process):
        (info,) = httpx.get(f"{url}/models", timeout=30).json()["models"]
        config = httpx.get(f"{url}/v2/models/{MODEL}/config", timeout=30).json()
        supervisor = process.pid
        (inference,) = role_pids(supervisor, "vitserve-infer")
        os.kill(inference, signal.SIGKILL)
        deadline = time.monotonic() + 120  # a liveness bound, not a measurement
        while not (again := kept_by_a_new_process(url, supervisor, inference)):
            assert time.monotonic() < deadline, f"no new inference process ran the kept plan: {again}"
            time.sleep(0.1)
    measured = info["plan_measured"]
    plans = {p for p in verified(read_entry(SOURCE)) if why_not(p) is None}
    assert set(measured) == {p.name for p in plans} and all(set(rates) == {"1", "16"} for rates in measured.values())
    score = {p: math.sqrt(measured[p.name]["1"] * measured[p.name]["16"]) for p in plans}
    assert info["plan"] == pick(score)[0].name and info["plan_reason"].startswith(pick(score)[1])
    assert config["parameters"]["plan"] == {"string_value": info["plan"]}
    assert (again["plan"], again["plan_measured"]) == (info["plan"], measured)
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1


def kept_by_a_new_process(url: str, supervisor: int, killed: int) -> dict | None:
    """The model's /models entry once an inference process other than the killed one serves it, saying it runs the
    kept plan (a worker shows the killed one's status until it joins the new one); None before."""
    if not [pid for pid in role_pids(supervisor, "vitserve-infer") if pid != killed]:
        return None
    try:
        (info,) = httpx.get(f"{url}/models", timeout=10).json()["models"]
    except (httpx.HTTPError, ValueError):
        return None
    return info if info["ready"] and info["plan_reason"].startswith("measured before on this host and kept") else None


def test_the_pick_is_the_fastest_unless_a_higher_precision_is_within_the_margin():
    """Figures set, not measured: the rule alone."""
    ort32, ov32, bf16, int8 = (CpuPlan("onnxruntime", "fp32"), CpuPlan("openvino", "fp32"),
                               CpuPlan("openvino", "bf16"), CpuPlan("onnxruntime", "int8"))
    assert pick({ort32: 100, bf16: 120}) == (bf16, "the fastest here of 2 verified plans")
    plan, why = pick({ort32: 100, bf16: 109})
    assert plan == ort32 and why.startswith("within 10% of the fastest here (openvino:bf16, 109 against 100")
    assert pick({ort32: 100, ov32: 105, int8: 108})[0] == ov32  # the fastest of the highest precision within it
    assert pick({ort32: 100, ov32: 100})[0] == ort32  # a tie: the export's order
    assert pick({int8: 150, bf16: 140, ort32: 100})[0] == bf16


def test_a_setting_gives_each_model_its_own_plan_or_the_one_for_every_model():
    setting = "shapes-deit=openvino:fp32,shapes-vit@2=first,onnxruntime:fp32"
    assert model_spec(setting, "shapes-deit") == ("openvino:fp32", True)
    assert model_spec(setting, "shapes-swin") == ("onnxruntime:fp32", False)
    assert model_spec("shapes-deit=measure", "shapes-swin") == ("auto", False)
    assert model_spec("first", "shapes-swin") == ("first", False)


def test_auto_measures_once_per_host_and_graph_and_only_where_asked_or_where_the_key_changed(tmp_path, monkeypatch):
    """Kept by what the choice depends on: the same key reuses it unmeasured, other threads measure anew, so does
    `measure`; a graph loaded while others serve is never measured beside them."""
    entry, counted = read_entry(SOURCE), []
    measure = cpu_plans.measure
    monkeypatch.setattr(cpu_plans, "measure", lambda *args: counted.append(args) or measure(*args))

    def chosen(setting: str = "auto", threads: int = 0, batches: tuple = (1, 16), now: bool = True):
        return choose(entry, input_names(entry), list(batches), setting, threads, keep_in=tmp_path, measure_now=now)

    first, again = chosen(), chosen()
    assert len(counted) == 1 and (again.plan, again.measured) == (first.plan, first.measured)
    assert again.reason == f"measured before on this host and kept ({tmp_path})"
    chosen(threads=1)
    assert len(counted) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    chosen("measure")
    assert len(counted) == 3
    serving = chosen(batches=(1, 8), now=False)  # a key nothing was kept for
    assert len(counted) == 3 and serving.plan == verified(entry)[0] and "not measured beside" in serving.reason


def test_a_kept_choice_that_is_garbled_names_no_plan_here_or_cannot_be_written_is_measured_anew(tmp_path,
                                                                                                  monkeypatch):
    """The folder of kept choices is a cache: what it holds is checked, never trusted. Not JSON, a record of another
    shape, a plan this host does not run: each measured anew and kept over it. A folder that cannot be written to
    serves all the same, saying so."""
    entry, counted = read_entry(SOURCE), []
    measure = cpu_plans.measure
    monkeypatch.setattr(cpu_plans, "measure", lambda *args: counted.append(args) or measure(*args))

    def chosen(folder: Path):
        return choose(entry, input_names(entry), [1, 16], "auto", keep_in=folder)

    first = chosen(tmp_path)
    (kept,) = tmp_path.glob("*.json")
    record = json.loads(kept.read_text())
    for garbled in (b"\x00not json", json.dumps({**record, "measured": "fast"}).encode(),
                    json.dumps({**record, "plan": "openvino:fp64"}).encode(), json.dumps([record]).encode()):
        kept.write_bytes(garbled)
        again = chosen(tmp_path)
        assert again.reason.startswith(("the fastest here", "within 10%")), (garbled, again.reason)
        assert json.loads(kept.read_text())["plan"] == again.plan.name  # kept over the garbled one
    assert len(counted) == 5 and first.plan in {p for p in verified(entry) if why_not(p) is None}
    blocked = tmp_path / "a-file-not-a-folder"
    blocked.write_text("")
    unkept = chosen(blocked / "plans")
    assert f"(not kept in {blocked / 'plans'}, " in unkept.reason and unkept.reason.endswith("each start measures)")


def test_a_plan_setting_outside_its_grammar_is_refused_at_start_up():
    for setting in ("fastest", "onnxruntime:fp64", "tensorrt:fp16", "shapes-deit=", "=openvino:fp32",
                    "shapes-deit=openvino:fp32;first", "auto,", "a b=first", "x" * 10 + "=openvino:bf16 "):
        with pytest.raises(ValidationError):
            Settings(cpu_plan=setting)
    assert Settings(cpu_plan="shapes-deit=openvino:fp32,shapes-vit@2=first,measure").cpu_plan


@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_answers_an_image_as_it_would_alone_at_batches_of_2_and_16(plan):
    """A photo among shapes and noise: its outputs are its own, whatever its batchmates. Dynamic int8 quantizes a
    batch tensor with one scale, which moved a photo's logits by 0.012 beside noise: it runs its images one at a
    time, so that they are exactly the image's alone; the other plans within fp32's 1e-5, bf16 within its gate."""
    found, entry = runnable(plan), read_entry(SOURCE)
    runner = choose(entry, input_names(entry), [1, 16], plan).runner
    noise = np.random.default_rng(0).integers(0, 256, (8, 96, 96, 3), np.uint8)
    images = np.concatenate([model_pixels(SOURCE, photo_bytes("chelsea", "JPEG"))[None], noise,
                             np.stack([np.asarray(s) for s in SHAPES[:7]])])
    none = np.zeros((0, 3, 96, 96), np.float32)
    alone = [runner.run(images[i:i + 1], none) for i in range(16)]
    gate = next(p for p in json.loads((SOURCE / "manifest.json").read_text())["plans"] if p["runtime"] == found.runtime
                and p["precision"] == found.precision).get("parity", {})
    atol = {"fp32": 1e-5, "int8": 0.0}.get(found.precision, gate.get("logits_max_abs_diff"))
    for batch in (2, 16):
        together = runner.run(images[:batch], none)
        for name in ("logits", "embeddings"):
            np.testing.assert_allclose(together[name], np.concatenate([a[name] for a in alone[:batch]]), atol=atol,
                                       rtol=0, err_msg=f"{plan} {name} at batch {batch}")


def test_a_plan_pinned_for_a_model_its_export_did_not_verify_is_refused_saying_what_it_did(tmp_path):
    """Named for the model, the pin is refused; pinned for every model, it runs where the export verified it and the
    others take auto, saying why."""
    manifest = json.loads((SOURCE / "manifest.json").read_text())
    kept = [p for p in manifest["plans"] if (p["runtime"], p["precision"]) != ("openvino", "bf16")]
    failed = {"runtime": "openvino", "precision": "bf16", "reason": "top-1 agreement 0.970 on held-out data"}
    root = repository(tmp_path, plans=kept, plans_refused=[failed])
    answers = {}
    for setting in (f"{MODEL}=openvino:bf16", "openvino:bf16"):
        settings = Settings(model_repository=root, warmup_runs=0, cpu_plan=setting, cpu_plan_dir=tmp_path / "plans")
        answers[setting] = asyncio.run(served(settings, [("GET", "/models", {}),
                                                         ("POST", "/classify", {"files": UPLOADS[:1]})]))
    models, classified = answers[f"{MODEL}=openvino:bf16"]
    (info,) = models.json()["models"]
    assert not info["ready"] and f"VITSERVE_CPU_PLAN={MODEL}=openvino:bf16: {MODEL}: its export did not verify it" \
        in info["error"]
    assert "onnxruntime:fp32" in info["error"] and "openvino:bf16 failed its gate: top-1 agreement 0.970" in info[
        "error"]
    assert classified.status_code == 503 and classified.json()["error"]["code"] == "model_unavailable"
    (info,) = answers["openvino:bf16"][0].json()["models"]
    assert info["ready"] and info["plan"] != "openvino:bf16"
    assert "(VITSERVE_CPU_PLAN=openvino:bf16 is not for it: its export did not verify it)" in info["plan_reason"]
