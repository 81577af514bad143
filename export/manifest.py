"""The model repository manifest, validated by the repository package, which the service reads with (one contract,
one check)."""
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import onnxruntime as ort

from repository import sha256
from repository import validate_manifest as validate

__all__ = ["file_entry", "now", "package_versions", "sha256", "validate"]


def file_entry(path: Path) -> dict:
    return {"path": path.name, "sha256": sha256(path), "bytes": path.stat().st_size}


def package_versions() -> dict[str, str]:
    """What made the graph; ONNX Runtime by its module, which onnxruntime and onnxruntime-gpu both provide."""
    return {**{name: version(name) for name in ("torch", "onnx", "onnxscript", "vitserve")},
            "onnxruntime": ort.__version__}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
