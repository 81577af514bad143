"""The images built from the project's Dockerfile with podman, run and answered, as a user deploys them.

Needs root, podman, runc and debootstrap (.ci/run installs them from Debian) and PyPI for the image's pip; skips
with the reason where a tool is missing or podman cannot run a container here. The base is made locally
(deploy/local-base.sh: no registry is reachable) and kept in podman's store, so only the first run pays for it
(about a minute); the CPU image takes about half a minute. The GPU image (3 GB of CUDA libraries) is built only
by `make test-slow`.
"""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from service_process import ROOT, direct_probabilities, free_port, model_pixels, photo_bytes

pytestmark = pytest.mark.container

CONF = ROOT / "deploy" / "containers.conf"
BASE = "localhost/vitserve-base:bookworm"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")  # outbound TLS may be re-signed: the image's pip trusts it


def podman(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env={**os.environ, "CONTAINERS_CONF": str(CONF)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def why_podman_cannot_run() -> str | None:
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (.ci/run installs them: apt-get install podman runc debootstrap)"
    if os.geteuid() != 0:
        return "debootstrap and rootful podman need root"
    made = subprocess.run(["bash", "deploy/local-base.sh", BASE], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CONTAINERS_CONF": str(CONF)})
    if made.returncode != 0:
        return f"the local base image could not be made: {made.stderr.strip()[-500:]}"
    ran = podman("run", "--rm", BASE, "true", timeout=120)
    return f"podman cannot run a container here: {ran.stderr.strip()[-500:]}" if ran.returncode else None


def build(runtime: str) -> str:
    tag = f"localhost/vitserve:{runtime}-test"
    secret = ["--secret", f"id=ca,src={HOST_CA}"] if HOST_CA.exists() else []
    built = podman("build", "--format", "docker", "--network", "host", *secret, "--build-arg", f"BASE={BASE}",
                   "--build-arg", f"RUNTIME={runtime}", "--tag", tag, ".", timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return tag


def in_image(tag: str, code: str) -> str:
    ran = podman("run", "--rm", tag, "python", "-c", code, timeout=120)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


@pytest.fixture(scope="module")
def podman_ready():
    reason = why_podman_cannot_run()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cpu_image(podman_ready) -> str:
    return build("cpu")


def installed(tag: str) -> dict[str, str]:
    listing = in_image(tag, "import importlib.metadata as m, json; "
                            "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")
    return json.loads(listing)


def test_the_cpu_image_is_small_numeric_non_root_and_carries_plain_onnxruntime_and_openvino_without_torch(
        cpu_image):
    config = json.loads(podman("image", "inspect", cpu_image).stdout)[0]
    assert config["Config"]["User"] == "10001:10001"
    assert "/health/ready" in " ".join(config["Healthcheck"]["Test"])  # kept: built --format docker
    packages = installed(cpu_image)
    assert "onnxruntime" in packages and "onnxruntime-gpu" not in packages and "torch" not in packages
    assert "openvino" in packages  # the CPU plans' second runtime (service/engine/openvino_runtime.py)
    # OpenCV samples the model's crop (service/images/decode.py), its headless build: no GUI libraries in the image
    assert {name for name in packages if name.startswith("opencv")} == {"opencv-python-headless"}
    pins = dict(line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()[1:])
    seeded = {"pip", "setuptools"}  # by the base's venv, not by the lock
    assert {name: version for name, version in pins.items() if name.lower() in packages.keys() - seeded} == {
        name: packages[name.lower()] for name in pins if name.lower() in packages.keys() - seeded}
    print(f"\nCPU image: {config['Size'] / 1e6:.0f} MB")


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_the_cpu_image_serves_every_route_as_a_direct_session_and_stops_cleanly(cpu_image):
    port, grpc_port, name = free_port(), free_port(), f"vitserve-test-{os.getpid()}"
    # (the first CPU plan, ONNX Runtime's fp32, as the tests' other servers: the answers below are its, to 1e-5)
    started = podman("run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:8000",
                     "--publish", f"127.0.0.1:{grpc_port}:8001", "--env", "VITSERVE_CPU_PLAN=first", cpu_image)
    assert started.returncode == 0, started.stderr
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not ready(url):
            assert time.monotonic() < deadline, f"not ready in 120 s:\n{podman('logs', name).stderr[-3000:]}"
            assert podman("container", "exists", name).returncode == 0, "the container exited"
            time.sleep(0.2)
        assert podman("healthcheck", "run", name).returncode == 0  # the image's own HEALTHCHECK

        jpeg = photo_bytes("chelsea", "JPEG")
        classified = httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", jpeg)},
                                params={"model": "shapes-swin", "top_k": 6, "attention": "true"}, timeout=60)
        assert classified.status_code == 200, classified.text
        result = classified.json()["results"][0]
        got = {p["index"]: p["score"] for p in result["predictions"]}
        want = direct_probabilities(ROOT / "model_repository" / "shapes-swin", jpeg)
        np.testing.assert_allclose([got[i] for i in range(6)], want, atol=1e-5)
        with triton.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:  # the Open Inference Protocol's gRPC
            x = model_pixels(ROOT / "model_repository" / "shapes-swin", jpeg)[None]
            tensor = triton.InferInput("images", list(x.shape), "UINT8")
            tensor.set_data_from_numpy(x)
            logits = client.infer("shapes-swin", [tensor]).as_numpy("logits")[0].astype(np.float64)
        np.testing.assert_allclose(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum(), want,
                                   atol=1e-5)
        png = httpx.get(f"{url}{result['attention_map_url']}", timeout=60)
        assert png.status_code == 200 and png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
        faces = httpx.post(f"{url}/expression", files={"file": ("astronaut.jpg", photo_bytes("astronaut", "JPEG"))},
                           timeout=60)
        assert faces.status_code == 200, faces.text
        (face,) = faces.json()["faces"]  # the repository's MTCNN is in the image
        assert len(face["landmarks"]) == 5
    finally:
        stopped = podman("stop", "--time", "30", name, timeout=60)
        state = json.loads(podman("inspect", name).stdout)[0]["State"]
        logs = podman("logs", name)
        podman("rm", "--force", name)
    assert stopped.returncode == 0 and state["ExitCode"] == 0, logs.stdout[-2000:] + logs.stderr[-2000:]
    assert "Application shutdown complete" in logs.stdout + logs.stderr
    assert '"POST /classify?model=shapes-swin&top_k=6&attention=true HTTP/1.1" 200' in logs.stdout + logs.stderr


@pytest.mark.slow
def test_the_gpu_image_carries_onnxruntime_gpu_with_cuda_and_cudnn_and_finds_them(podman_ready):
    tag = build("gpu")
    packages = installed(tag)
    assert "onnxruntime-gpu" in packages and "onnxruntime" not in packages and "torch" not in packages
    libraries = in_image(tag, "import pathlib, nvidia; print(*(p.name for d in nvidia.__path__ "
                              "for p in pathlib.Path(d).rglob('lib*.so*')))")
    for library in ("libcudart.so.13", "libcublas.so.13", "libcudnn.so.9", "libnvjpeg.so.13"):
        assert library in libraries.split(), libraries
    # no GPU here: the service still starts, says CUDA is not usable (and nothing raw from ORT), serves on the CPU
    device = podman("run", "--rm", tag, "python", "-c", "import logging; logging.basicConfig(level=logging.INFO); "
                    "from pathlib import Path; from repository import servable; from service.engine.runtime import "
                    "choose_device; print(choose_device(servable(Path('model_repository'))[0], None))", timeout=120)
    assert device.returncode == 0 and device.stdout.strip() == "CPUExecutionProvider", device.stderr
    assert "CUDA is not usable on this host" in device.stderr
    assert ":onnxruntime:" not in device.stderr and "EP Error" not in device.stdout, device.stderr  # ORT's own lines
    print(f"\nGPU image: {json.loads(podman('image', 'inspect', tag).stdout)[0]['Size'] / 1e6:.0f} MB")
