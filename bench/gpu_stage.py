"""What a GPU host lacks (it has no package index: docs/development.md#the-gpu-check), the project's committed tree
among it, packed here into parts that reach it in at most 5 device calls, the check's own call included.

    python bench/gpu_check.py --export-cache /tmp/gpu-cache     # the graphs, without their weights (2 minutes)
    python bench/gpu_stage.py pack --cache /tmp/gpu-cache        # .gpu/partNN, and the calls to make
    python bench/gpu_stage.py update                             # after a fix there: .gpu/update.tar.xz, and its call

A device call carries the working tree and the paths it names in carry, 64 MiB in all. The tree itself is over that
(81.5 MiB on 2026-12-06, its embedded graphs and weights), so no call carries it: `git switch --orphan` empties the
checkout (its ignored files stay, and .gitignore's patterns are copied into .git/info/exclude first, since
.gitignore leaves with the tree), and each call carries one part of 62 MiB to /root/stage. The committed tree travels
in the payload (git archive, 52 MiB once compressed), and the last call, which carries the last part, unpacks it all
into /tmp/gpu-stage and runs the check in /tmp/gpu-stage/tree (bench/gpu_setup.sh installs the rest).

The payload: the tree at HEAD, onnxruntime-gpu unpacked with its CUDA provider alone (the TensorRT provider and the
C-API library left out), the serving wheels the host lacks at requirements.lock's versions, nvImageCodec with
nvJPEG, wrk with its libluajit, and the cache of exported graphs, without their weights (bench/weightless.py).
"""
import argparse
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from weightless import strip_all  # noqa: E402

STAGE = ROOT / ".gpu"
STAGED = STAGE / "commit"  # the commit pack staged, which update's files are counted from
UPDATE = STAGE / "update.tar.xz"
CALL_BYTES = 64 * 2**20  # what a device call carries in all (/work/.library/device/README.md)
PART_BYTES = 62 * 2**20  # a call carries 64 MiB: an empty tree's few files and the part
MAX_CALLS = 5  # issue 74: the parts' calls, the check's among them
REMOTE = "/tmp/gpu-stage"  # where the last call unpacks the payload: the tree in tree/, the graphs in cache/
# the serving stack the GPU host lacks (its image has numpy, Pillow, OpenCV, uvloop, httpx, psutil, pytest-xdist,
# CuPy and torch): ../shared/gpu/stage.sh's list, and simplejpeg
WHEELS = ["fastapi", "starlette", "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "annotated-types",
          "typing-inspection", "annotated-doc", "uvicorn", "httptools", "python-multipart", "jsonschema",
          "jsonschema-specifications", "referencing", "rpds-py", "fastapi-offline", "grpcio", "protobuf",
          "prometheus-client", "opentelemetry-api", "py-spy", "nvidia-nvimgcodec-cu13", "nvidia-nvjpeg", "pi-heif",
          "simplejpeg",
          # the tracing extra, for the service part's traces switch (the host has requests)
          "opentelemetry-sdk", "opentelemetry-semantic-conventions", "opentelemetry-exporter-otlp-proto-http",
          "opentelemetry-exporter-http-transport", "opentelemetry-exporter-otlp-common",
          "opentelemetry-exporter-otlp-proto-common", "opentelemetry-proto", "googleapis-common-protos"]
ORT_LEFT_OUT = ("onnxruntime/capi/libonnxruntime_providers_tensorrt.so", "onnxruntime/capi/libonnxruntime.so.")
# the GPU hosts' Python (../shared/gpu/README.md)
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg for tag in ("manylinux_2_34", "manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014",
                    "manylinux1") for arg in ("--platform", f"{tag}_x86_64")]


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def pinned(name: str) -> str:
    """name==version from requirements.lock (names compared as pip does)."""
    key = re.sub(r"[-_.]+", "[-_.]", name)
    found = re.search(rf"^{key}==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M | re.I)
    return f"{name}=={found[1]}" if found else name


def download(folder: Path, names: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(folder),
                    *map(pinned, names)], check=True)


def onnxruntime_gpu(payload: Path) -> None:
    """onnxruntime-gpu's wheel, unpacked into the payload without what the service never loads."""
    download(STAGE / "ort", ["onnxruntime-gpu"])
    (wheel,) = (STAGE / "ort").glob("onnxruntime_gpu-*.whl")
    with zipfile.ZipFile(wheel) as z:
        for member in z.infolist():
            if not member.filename.startswith(ORT_LEFT_OUT):
                z.extract(member, payload)
    shutil.rmtree(STAGE / "ort")


def wrk(payload: Path) -> None:
    found = shutil.which("wrk")
    if found is None:
        sys.exit("install wrk here first: apt-get install wrk")
    libs = re.findall(r"=> (\S*libluajit\S*)", subprocess.run(["ldd", found], capture_output=True, text=True).stdout)
    (payload / "wrk").mkdir()
    for path in [found, *libs]:
        shutil.copy(Path(path).resolve(), payload / "wrk" / Path(path).name)


def committed_tree(payload: Path) -> None:
    """HEAD's files, as the check runs them (its commit names the results)."""
    (payload / "tree").mkdir(parents=True)
    subprocess.run(f"git archive --format=tar HEAD | tar -xf - -C {payload / 'tree'}", shell=True, cwd=ROOT,
                   check=True)


def tree_left_behind() -> int:
    """Bytes an emptied checkout still carries: the untracked files git does not ignore."""
    files = [ROOT / f for f in git("ls-files", "-z", "--others", "--exclude-standard").split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file())


def keep_ignores() -> None:
    """.gitignore's patterns in .git/info/exclude too: with the tree gone, .gitignore is gone, and the ignored
    folders (.venv, .gpu, build) would travel."""
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    have = set(exclude.read_text().splitlines()) if exclude.exists() else set()
    wanted = [line for line in (ROOT / ".gitignore").read_text().splitlines() + ["/.gpu/"]
              if line and not line.startswith("#") and line not in have]
    with exclude.open("a") as out:
        out.writelines(f"{line}\n" for line in wanted)


def check_command(commit: str) -> str:
    """The check, run in the unpacked tree (a copy without .git: GPU_CHECK_COMMIT names its commit)."""
    return (f"cd {REMOTE}/tree && source bench/gpu_setup.sh && GPU_CHECK_COMMIT={commit} python3 bench/gpu_check.py "
            "--out $OUT")


def calls(parts: list[str], branch: str, commit: str) -> list[str]:
    """What to do, in order: the steps here and the device calls (carry, command), each from the emptied checkout;
    the last call carries the last part, unpacks them all and runs the check."""
    steps = ["here:  git switch --orphan gpu-staging   # no call carries the tree: it travels in the parts"]
    steps += [f"call {i + 1}: carry [\"{part}\"]  command: mkdir -p /root/stage && mv {part} /root/stage/ && "
              "ls /root/stage  (timeout_s 60)" for i, part in enumerate(parts[:-1])]
    steps.append(f"call {len(parts)}: carry [\"{parts[-1]}\"]  command: mkdir -p /root/stage {REMOTE} && "
                 f"mv {parts[-1]} /root/stage/ && cat /root/stage/part* | xz -dc -T0 | tar -xf - -C {REMOTE} && "
                 f"{check_command(commit)}  (timeout_s 540)")
    steps.append(f"here:  git switch {branch}")
    return steps


def update_calls(update: str, branch: str, commit: str) -> list[str]:
    """A rerun after fixes, on the warm host: the files changed since the staged commit unpacked over its tree."""
    return ["here:  git switch --orphan gpu-staging",
            f"call: carry [\"{update}\"]  command: tar -xJf {update} -C {REMOTE}/tree && {check_command(commit)} "
            "--parts ...  (timeout_s as the parts' boxes need)",
            f"here:  git switch {branch}"]


def pack(cache: Path, xz_level: int) -> None:
    if git("status", "--porcelain", "--untracked-files=no"):
        sys.exit("commit first: the part calls empty the checkout with git switch, and the check runs what is "
                 "committed (its commit names the results)")
    if not (cache / "deit_tiny_patch16_224" / "manifest.json").is_file():
        sys.exit(f"{cache} has no exported graphs: python bench/gpu_check.py --export-cache {cache}")
    shutil.rmtree(STAGE, ignore_errors=True)
    payload = STAGE / "payload"
    committed_tree(payload)
    download(payload / "whl", WHEELS)
    onnxruntime_gpu(payload)
    wrk(payload)
    shutil.copytree(cache, payload / "cache")
    strip_all(payload / "cache")  # a check run here refills the cache it reads: weightless again, as exported
    size = sum(f.stat().st_size for f in payload.rglob("*") if f.is_file())
    print(f"packing {size / 2**20:.0f} MiB (xz -{xz_level}, a few minutes on 2 cores)", flush=True)
    subprocess.run(f"tar -C {payload} -cf - . | xz -{xz_level} -T0 > {STAGE}/payload.tar.xz", shell=True,
                   check=True)
    shutil.rmtree(payload)
    subprocess.run(["split", "-b", str(PART_BYTES), "-d", "-a", "2", "payload.tar.xz", "part"], cwd=STAGE,
                   check=True)
    (STAGE / "payload.tar.xz").unlink()
    commit = git("rev-parse", "--short", "HEAD").strip()
    STAGED.write_text(commit + "\n")
    keep_ignores()
    parts = sorted(STAGE.glob("part*"))
    left = tree_left_behind()
    steps = calls([str(p.relative_to(ROOT)) for p in parts], git("branch", "--show-current").strip(), commit)
    print(f"{len(parts)} parts of <= {PART_BYTES >> 20} MiB ({sum(p.stat().st_size for p in parts) / 2**20:.0f} MiB); "
          f"the emptied checkout carries {left / 2**20:.1f} MiB beside each; {len(parts)} device calls, back to "
          "back (a host idle 30 s is released with everything on it):")
    print("\n".join(f"  {step}" for step in steps))
    if left + PART_BYTES > CALL_BYTES or len(parts) > MAX_CALLS:
        sys.exit(f"over the limits: {len(parts)} calls (at most {MAX_CALLS}), {left} bytes of untracked files "
                 "beside each part (commit or ignore them)")


def update() -> None:
    """The files changed since the staged commit (git diff; a file deleted stays there), for a rerun."""
    if not STAGED.is_file():
        sys.exit("nothing staged here: python bench/gpu_stage.py pack first")
    if git("status", "--porcelain", "--untracked-files=no"):
        sys.exit("commit first: the update carries what is committed")
    staged, commit = STAGED.read_text().strip(), git("rev-parse", "--short", "HEAD").strip()
    changed = [f for f in git("diff", "-z", "--name-only", "--diff-filter=d", staged, "HEAD").split("\0") if f]
    if not changed:
        sys.exit(f"nothing changed since the staged commit {staged}")
    subprocess.run(["tar", "-cJf", str(UPDATE), "--", *changed], cwd=ROOT, check=True)
    if UPDATE.stat().st_size + tree_left_behind() > CALL_BYTES:
        sys.exit(f"{UPDATE} is over a call's {CALL_BYTES >> 20} MiB: pack again")
    print(f"{len(changed)} files changed since {staged} ({UPDATE.stat().st_size / 2**10:.0f} KiB); the rerun, on "
          "the host still warm (every call from the emptied checkout: the tree is over a call's limit):")
    print("\n".join(f"  {step}" for step in update_calls(str(UPDATE.relative_to(ROOT)),
                                                        git("branch", "--show-current").strip(), commit)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["pack", "update"])
    p.add_argument("--cache", type=Path, default=Path("/tmp/gpu-cache"),
                   help="the graphs python bench/gpu_check.py --export-cache DIR wrote (default: /tmp/gpu-cache)")
    p.add_argument("--xz-level", type=int, default=6)
    args = p.parse_args()
    if args.action == "pack":
        pack(args.cache, args.xz_level)
    else:
        update()


if __name__ == "__main__":
    main()
