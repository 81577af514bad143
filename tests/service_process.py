"""Start the real service (`python -m service`) on a free loopback port, for end-to-end tests."""
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from skimage import data as photos

from service.preprocess import InputPolicy, prepare

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_service(wait_ready: bool = True, **settings) -> Iterator[str]:
    """Yield the base URL of a service started with VITSERVE_<NAME> settings; stop it afterwards."""
    port = free_port()
    env = {**os.environ, **{f"VITSERVE_{k.upper()}": str(v) for k, v in settings.items()}}
    proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, "/health/ready" if wait_ready else "/health/live", proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(url: str, path: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode}:\n{proc.stdout.read().decode()}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} did not answer 200 within {timeout}s")


def photo_bytes(name: str, fmt: str) -> bytes:
    """A real photograph from scikit-image, encoded as JPEG or PNG."""
    buf = io.BytesIO()
    Image.fromarray(getattr(photos, name)()).save(buf, format=fmt)
    return buf.getvalue()


def direct_probabilities(model_dir: Path, image: bytes) -> np.ndarray:
    """What the exported model says of an image, through the service's preprocessing and a plain ORT session."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    x, _ = prepare(image, InputPolicy.from_manifest(manifest["input"]), 10**8)
    session = ort.InferenceSession(model_dir / "model.onnx", providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"pixel_values": x[None]})[0][0].astype(np.float64)
    return np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()


def process_metrics(text: str) -> dict[str, float]:
    """The process_* samples of Prometheus text: CPU seconds, resident memory, open files."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("process_")}


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and ",".join(sorted(match.group(1).split(","))) == want:
            return float(match.group(2))
    return 0.0
