"""The model repository manifest: written next to model.onnx, validated against schemas/manifest.schema.json."""
import hashlib
import json
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import jsonschema

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "manifest.schema.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(path: Path) -> dict:
    return {"path": path.name, "sha256": sha256(path), "bytes": path.stat().st_size}


def package_versions() -> dict[str, str]:
    return {name: version(name) for name in ("torch", "onnx", "onnxscript", "onnxruntime-gpu", "vitserve")}


def validate(manifest: dict) -> None:
    """Raises jsonschema.ValidationError naming the first offending field."""
    jsonschema.validate(manifest, json.loads(SCHEMA_PATH.read_text()))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
