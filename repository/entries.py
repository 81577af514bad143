"""Model folders: manifest.json validated against its schema, every graph against its sha256.

A folder holds a model clients call (manifest.schema.json) or the face detector that /expression uses
(face_detector.schema.json, task face-detection). A model folder is flat (its graphs and manifest.json in it:
version 1) or holds versions, one numbered subfolder each (NAME/1/, NAME/2/ ...); its policy.json says which
serve: {"latest": N} (the default, N = 1), {"all": true} or {"specific": [1, 3]}. Each version serving is an
entry of its own, keyed NAME (flat) or NAME@VERSION. A folder that fails is reported with the reason and not
served; the others are.
"""
import hashlib
import json
from dataclasses import dataclass
from functools import cache
from collections.abc import Iterator
from pathlib import Path

import jsonschema

from .policy import InputPolicy

FACE_DETECTION = "face-detection"
SCHEMAS = {"model": "manifest.schema.json", FACE_DETECTION: "face_detector.schema.json"}
SCHEMA_VERSION = 2


class RepositoryError(ValueError):
    """A model folder that cannot be served; the message says why."""


@dataclass(frozen=True, eq=False)  # one object per folder read: hashed by identity
class ModelEntry:
    folder: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def key(self) -> str:
        """What the service keys a version serving by: NAME for a flat folder, NAME@VERSION for a version folder."""
        return f"{self.name}@{self.folder.name}" if self.folder.name.isdigit() else self.name

    @property
    def location(self) -> str:
        """Its folder as the repository's problems name it: NAME, or NAME/VERSION."""
        return _where(self.folder)

    @property
    def version(self) -> int:
        """The number of its version folder (NAME/2/ is version 2); a flat folder's model is version 1."""
        return int(self.folder.name) if self.folder.name.isdigit() else 1

    @property
    def task(self) -> str:
        return self.manifest["task"]

    @property
    def labels(self) -> list[str]:
        return self.manifest["labels"]

    @property
    def scores(self) -> str:
        """softmax (one class per image), or sigmoid (a multi-label classifier: each label scored on its own)."""
        return self.manifest.get("scores", "softmax")

    @property
    def attention(self) -> dict | None:
        """How its attention maps are made; None for a model without attention outputs (a CNN)."""
        return self.manifest.get("attention")

    @property
    def embedding(self) -> dict | None:
        """Its graph's image embedding (output, size, pooling); None for a model without one (a CNN)."""
        return self.manifest.get("embedding")

    @property
    def precision(self) -> str:
        return self.manifest["precision"]

    @property
    def policy(self) -> InputPolicy:
        return InputPolicy.from_manifest(self.manifest["input"])

    @property
    def preprocessing(self) -> dict:
        """How a photo becomes the model's input, as a client that sends tensors needs to know it."""
        return {k: v for k, v in self.manifest["input"].items() if k not in ("name", "dtype", "layout")}

    def path(self, file: str = "model") -> Path:
        return self.folder / self.manifest["files"][file]["path"]

    def has(self, file: str) -> bool:
        return file in self.manifest["files"]


@cache
def _schema(kind: str) -> dict:
    return json.loads(Path(__file__).with_name(SCHEMAS[kind]).read_text())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(entry: ModelEntry, file: str) -> Path:
    """The path of one of the entry's graphs, after checking it is there and its sha256 matches."""
    if file not in entry.manifest["files"]:
        raise RepositoryError(f"{entry.location}: its manifest names a graph {file!r} that its files do not list")
    path, expected = entry.path(file), entry.manifest["files"][file]["sha256"]
    if not path.is_file():
        raise RepositoryError(f"{entry.location}: {path.name} is missing")
    if sha256(path) != expected:
        raise RepositoryError(f"{entry.location}: {path.name} does not match the sha256 in its manifest")
    return path


def validate_manifest(manifest: dict) -> None:
    """Raises jsonschema.ValidationError naming the first offending field."""
    kind = FACE_DETECTION if isinstance(manifest, dict) and manifest.get("task") == FACE_DETECTION else "model"
    jsonschema.validate(manifest, _schema(kind))


def _where(folder: Path) -> str:
    """A folder as messages name it: NAME, or NAME/VERSION."""
    return f"{folder.parent.name}/{folder.name}" if folder.name.isdigit() else folder.name


def read_entry(folder: Path) -> ModelEntry:
    where = _where(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        if isinstance(manifest, dict) and manifest.get("schema_version", SCHEMA_VERSION) < SCHEMA_VERSION:
            raise RepositoryError(f"{where}: exported by an older vitserve (manifest schema "
                                  f"{manifest['schema_version']}, float32 input); export it again with `python -m "
                                  "export` to get the uint8 image input")
        validate_manifest(manifest)
    except json.JSONDecodeError as e:
        raise RepositoryError(f"{where}: manifest.json is not JSON ({e})") from None
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise RepositoryError(f"{where}: manifest.json is invalid at {where}: {e.message}") from None
    entry = ModelEntry(folder, manifest)
    if manifest.get("version", entry.version) != entry.version:
        raise RepositoryError(f"{where}: its manifest says version {manifest['version']}")
    for file in ["model"] if entry.task != FACE_DETECTION else manifest["files"]:  # explain.onnx: on first use
        verify_file(entry, file)
    return entry


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def versions(folder: Path) -> list[int]:
    """The version numbers of a model folder's subfolders (NAME/1/, NAME/2/ ...), in order; [] when flat."""
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0)


def version_policy(folder: Path) -> dict:
    """A versioned model folder's policy.json ({"latest": 1} where it has none), checked."""
    path = folder / "policy.json"
    try:
        policy = json.loads(path.read_text()) if path.is_file() else {"latest": 1}
    except ValueError as e:
        raise RepositoryError(f"{folder.name}: policy.json is not JSON ({e})") from None
    ok = isinstance(policy, dict) and len(policy) == 1 and (
        (isinstance(policy.get("latest"), int) and policy["latest"] > 0) or policy.get("all") is True
        or (isinstance(policy.get("specific"), list) and policy["specific"]
            and all(isinstance(v, int) and v > 0 for v in policy["specific"])))
    if not ok:
        raise RepositoryError(f'{folder.name}: policy.json must be {{"latest": N}}, {{"all": true}} or '
                              f'{{"specific": [versions]}}, not {path.read_text().strip()}')
    return policy


def served_folders(folder: Path) -> list[Path]:
    """Where a model folder's serving graphs are: the folder itself (flat), or the version folders its policy
    names (oldest first; a version the policy names that is not there is not served)."""
    found = versions(folder)
    if not found:
        return [folder]
    policy = version_policy(folder)
    chosen = found[-policy["latest"]:] if "latest" in policy else found if "all" in policy else \
        [v for v in found if v in policy["specific"]]
    return [folder / str(v) for v in chosen]


def _serving(root: Path) -> Iterator[tuple[Path, Path | RepositoryError]]:
    """(model folder, each folder serving in it), or the reason its policy chooses none."""
    for folder in _folders(root):
        try:
            for served in served_folders(folder):
                yield folder, served
        except RepositoryError as e:
            yield folder, e


def scan(root: Path) -> tuple[list[ModelEntry], dict[str, str]]:
    """The servable entries, models and face detectors (sorted by name), and, by folder name, why the others
    are not."""
    if not root.is_dir():
        raise RepositoryError(f"no model repository at {root}")
    entries, problems, owners = [], {}, {}
    for model_folder, folder in _serving(root):
        if isinstance(folder, RepositoryError):
            problems[model_folder.name] = str(folder)
        elif not (folder / "manifest.json").is_file():
            problems[_where(folder)] = "no manifest.json: not a model folder (python -m export writes one)"
        else:
            try:
                entry = read_entry(folder)
            except (RepositoryError, OSError) as e:
                problems[_where(folder)] = str(e)
                continue
            entries.append(entry)
            owners.setdefault(entry.name, set()).add(model_folder)
    duplicates = sorted(name for name, folders in owners.items() if len(folders) > 1)
    if duplicates:
        raise RepositoryError(f"several folders declare the model name(s) {', '.join(duplicates)}")
    return entries, problems


def servable(root: Path) -> tuple[list[ModelEntry], dict[str, str]]:
    """The models clients call (not the face detectors) and why other folders are not served; failing when no
    model at all can be served."""
    entries, problems = scan(root)
    entries = [e for e in entries if e.task != FACE_DETECTION]
    if not entries:
        raise RepositoryError(f"no servable model in {root}" + "".join(f"; {k}: {v}" for k, v in problems.items()))
    return entries, problems


def _peek(folder: Path, key: str) -> object:
    """One field of a folder's manifest, unvalidated (None where there is no readable one)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get(key) if isinstance(manifest, dict) else None


def find_entries(root: Path, name: str) -> list[ModelEntry]:
    """The versions of the model `name` that its policy serves, read and verified as at start-up."""
    for folder in _folders(root):
        served = served_folders(folder)
        if any(_peek(f, "name") == name for f in served):
            return [read_entry(f) for f in served]
    raise RepositoryError(f"no folder of {root} holds a model named {name}")


def model_manifests(root: Path) -> dict[str, list[dict]]:
    """By model name, the manifests of the versions its policy serves (not the face detectors'), unvalidated:
    what a rescan compares with what it loaded."""
    found: dict[str, list[dict]] = {}
    for _, folder in _serving(root):
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError, TypeError):  # TypeError: a policy that chose nothing (scan reports it)
            continue
        if isinstance(manifest, dict) and isinstance(name := manifest.get("name"), str) \
                and manifest.get("task") != FACE_DETECTION:
            found.setdefault(name, []).append(manifest)
    return found


def face_detector(root: Path) -> tuple[ModelEntry | None, str | None]:
    """The repository's face detector (the first by folder name), or None and why there is none."""
    for _, folder in _serving(root):
        if not isinstance(folder, RepositoryError) and _peek(folder, "task") == FACE_DETECTION:
            try:
                return read_entry(folder), None
            except (RepositoryError, OSError) as e:
                return None, str(e)
    return None, f"no face detector in {root} (python -m export mtcnn writes one)"
