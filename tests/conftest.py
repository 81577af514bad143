import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reference"))  # fill.py and cases.py, shared with the generator

# No app a test builds in its own process takes Triton's gRPC port 8001 from the machine (running_service gives
# each server a free one)
os.environ["VITSERVE_GRPC_PORT"] = "0"

# Every server a test starts, in its process or in another, runs each model's first CPU plan without measuring the
# others (the quickest start: measuring them costs each start seconds); tests/test_cpu_plans.py measures and pins
os.environ.setdefault("VITSERVE_CPU_PLAN", "first")
# and keeps what a test's auto measures in this test process's own folder, never in the user's cache
if "VITSERVE_CPU_PLAN_DIR" not in os.environ:
    os.environ["VITSERVE_CPU_PLAN_DIR"] = tempfile.mkdtemp(prefix="vitserve-cpu-plans-")
    atexit.register(shutil.rmtree, os.environ["VITSERVE_CPU_PLAN_DIR"], True)

# The slowest files first (in that order: seconds in one worker, `--durations` of 2026-12-02, export 134 s down to
# hf_embeddings 24 s), then the rest as collected: `make test`'s workers take whole files (--dist loadfile), and a
# worker handed one of these last would leave the others idle while it finished.
SLOWEST_FIRST = ["test_export.py", "test_container.py", "test_faults.py", "test_timm_parity.py",
                 "test_model_control.py", "test_docs.py", "test_process_backend.py", "test_request_timeout.py",
                 "test_client_mistakes.py", "test_fuzz.py", "test_tracing.py", "test_service.py", "test_hf_folders.py",
                 "test_grpc.py", "test_hf_embeddings.py"]
_renamed = [name for name in SLOWEST_FIRST if not (ROOT / "tests" / name).is_file()]
assert not _renamed, f"tests/conftest.py's SLOWEST_FIRST names files that are gone: {_renamed}"


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept
