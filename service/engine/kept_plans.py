"""The CPU plan chosen for a graph on this host, kept on disk: every process, replica and restart on the host reuses
it. Measuring costs a start seconds, and its noise could choose otherwise at each start, so that an answer would
depend on the start (docs/serving.md#cpu-plans). A choice is kept under a key of all it depends on: the CPU, the
graph's files, the threads and the runtimes' versions; a change of any is a new key, measured anew, and
VITSERVE_CPU_PLAN=measure measures anew whatever is kept.
"""
import hashlib
import importlib.metadata
import json
import os
import re
from functools import cache
from pathlib import Path

from repository import ModelEntry


@cache
def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("unknown" without one)."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    return found[1].strip() if found else "unknown"


def runtime_versions() -> dict[str, str]:
    """The installed versions of the runtimes a plan may run on (an absent one left out)."""
    versions = {}
    for name in ("onnxruntime", "onnxruntime-gpu", "openvino"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def plan_key(entry: ModelEntry, threads: int, batches: list[int]) -> dict:
    """What a choice for this graph depends on: the CPU, each of its files' sha256, the threads a run uses, the batch
    sizes measured and the runtimes."""
    return {"cpu": cpu_model(), "cpus": len(os.sched_getaffinity(0)), "threads": threads, "batches": batches,
            "files": {name: f["sha256"] for name, f in sorted(entry.manifest["files"].items())},
            "plans": [f"{p['runtime']}:{p['precision']}" for p in entry.manifest.get("plans", [])],
            "runtimes": runtime_versions()}


def _path(folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{digest}.json"


def kept(folder: Path, key: dict) -> dict | None:
    """The choice kept for this key ({"plan", "measured", ...}), or None (none kept, or unreadable)."""
    try:
        record = json.loads(_path(folder, key).read_text())
    except (OSError, ValueError):
        return None
    whole = isinstance(record, dict) and record.get("key") == key and isinstance(record.get("plan"), str)
    return record if whole and isinstance(record.get("measured"), dict) else None


def keep(folder: Path, key: dict, plan: str, measured: dict[str, dict[str, float]]) -> str | None:
    """The choice written for the key, atomically (a process reading it meanwhile sees the old one or the new);
    why it could not be, where it could not (a folder this user may not write: each start then measures)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = _path(folder, key)
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        part.write_text(json.dumps({"key": key, "plan": plan, "measured": measured}, indent=1))
        part.replace(path)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None
