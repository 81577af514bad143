"""CUDA paths: skipped where the CUDA provider cannot start (CI has no GPU); run them on a GPU host."""
import json
import shutil

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from service_process import ROOT, photo_bytes, running_service

from export.__main__ import main as export_main
from service.runtime import CPU, CUDA, Runner, open_session

REPO = ROOT / "model_repository"


def cuda_works() -> bool:
    if CUDA not in ort.get_available_providers():
        return False
    return open_session(REPO / "shapes-vit" / "model.onnx", [CUDA]).get_providers()[0] == CUDA


pytestmark = pytest.mark.skipif(not cuda_works(), reason="the CUDA provider does not start on this host")


def test_cuda_runner_with_iobinding_matches_the_cpu():
    for name in ("shapes-vit", "shapes-deit", "shapes-swin", "expression-vit"):
        manifest = json.loads((REPO / name / "manifest.json").read_text())
        h, w = manifest["input"]["size"]
        rng = np.random.default_rng(0)
        images, x = rng.integers(0, 256, (3, h, w, 3), np.uint8), rng.standard_normal((2, 3, h, w), np.float32)
        inputs = (manifest["input"]["name"], manifest["tensor_input"]["name"])
        gpu, cpu = Runner(REPO / name / "model.onnx", inputs, [CUDA]), Runner(REPO / name / "model.onnx", inputs, [CPU])
        assert gpu.provider == CUDA
        got, want = gpu.run(images, x), cpu.run(images, x)
        for key in want:  # the opset-23 Attention CUDA kernel against the CPU one
            np.testing.assert_allclose(got[key], want[key], atol=1e-3, err_msg=f"{name} {key}")


def test_fp16_export_passes_its_gate_on_cuda_and_is_served_for_its_base_name(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "shapes-deit", repo / "shapes-deit")
    weights = ROOT / "models" / "demo" / "deit_micro_distilled_patch8_96" / "model.safetensors"
    export_main(["deit_micro_distilled_patch8_96", "--weights", str(weights), "--precision", "fp16",
                 "--name", "shapes-deit-fp16", "--out", str(repo)])
    manifest = json.loads((repo / "shapes-deit-fp16" / "manifest.json").read_text())
    assert manifest["parity"]["fp16"]["provider"] == CUDA and manifest["parity"]["fp16"]["top1_agreement"] >= 0.99
    with running_service(model_repository=repo) as url:
        models = {m["name"]: m for m in httpx.get(f"{url}/models").json()["models"]}
        assert models["shapes-deit"]["provider"] == CUDA and models["shapes-deit-fp16"]["ready"]
        # decided once at start-up, and reported as what runs: the fp16 sibling's graph
        assert (models["shapes-deit"]["precision"], models["shapes-deit"]["graph"]) == ("fp16", "shapes-deit-fp16")
        r = httpx.post(f"{url}/classify", files={"file": ("a.jpg", photo_bytes("chelsea", "JPEG"))})
        assert r.status_code == 200
