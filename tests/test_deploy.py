"""Deployment files, checked without a Docker engine (none runs on the development or CI machines)."""
import json
import re

import jsonschema
import yaml
from service_process import ROOT


def test_compose_file_follows_the_compose_specification():
    # tests/reference/compose-spec.json: compose-spec/compose-spec schema/compose-spec.json at commit
    # 170098ba07d9f53c383a41bfd4c5166b0a4529a6 (Apache-2.0)
    schema = json.loads((ROOT / "tests" / "reference" / "compose-spec.json").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)  # the file names draft-07 by an unregistered URL
    service = compose["services"]["vitserve"]
    assert service["ports"] == ["8000:8000"]
    assert all(key.startswith("VITSERVE_") for key in service["environment"])


def test_the_image_serves_without_torch_and_checks_readiness():
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+)", dockerfile, flags=re.M)
    assert "models" not in copied and "export" not in copied and {"service", "repository"} <= set(copied)
    assert "pip install --no-cache-dir --editable ." in dockerfile  # serving dependencies only, no extras
    assert "/health/ready" in dockerfile and 'CMD ["python", "-m", "service"]' in dockerfile
