"""The serving dependencies ../shared/gpu/stage.sh does not stage, carried to a GPU host (no package index there)
in the export cache: downloaded here at requirements.lock's versions, installed there where they do not import.

    python bench/gpu_wheels.py download DIR/wheels     # on the CPU host (gpu_check.py --export-cache does it)
    python bench/gpu_wheels.py install DIR/wheels      # on the GPU host (make gpu-check does it)

Standard library only: on the GPU host it runs before anything the service imports is there.
"""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# distribution -> the module it gives; opencv-python-headless's wheel (62 MB, four more staged parts) only when
# asked: the H100 image of 2026-11-27 served OpenCV's warp with stage.sh's wheels alone, so it has cv2
STAGED = {"simplejpeg": "simplejpeg"}
LARGE = {"opencv-python-headless": "cv2"}
# the GPU hosts' Python (../shared/gpu/README.md)
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64"]


def pinned(name: str) -> str:
    """name==version from requirements.lock."""
    found = re.search(rf"^{re.escape(name)}==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M)
    if found is None:
        raise SystemExit(f"{name} is not in requirements.lock")
    return f"{name}=={found.group(1)}"


def download(folder: Path, large: bool) -> None:
    names = [*STAGED, *(LARGE if large else {})]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(folder),
                    *map(pinned, names)], check=True)
    print(f"{folder}: {', '.join(names)}")


def install(folder: Path) -> None:
    """Each staged wheel whose module does not import, into the first PYTHONPATH folder (device-setup.sh's)."""
    target = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    modules = STAGED | LARGE
    for wheel in sorted(folder.glob("*.whl")):
        name = wheel.name.split("-")[0].replace("_", "-")
        if importlib.util.find_spec(modules.get(name, name)) is not None:
            continue
        if not target:
            raise SystemExit("no PYTHONPATH to install into: source .gpu/device-setup.sh first")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        target, str(wheel)], check=True)
        print(f"installed {wheel.name} into {target}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["download", "install"])
    p.add_argument("folder", type=Path)
    p.add_argument("--large", action="store_true", help="download: opencv-python-headless too")
    args = p.parse_args()
    if args.action == "download":
        download(args.folder, args.large)
    elif args.folder.is_dir():
        install(args.folder)


if __name__ == "__main__":
    main()
