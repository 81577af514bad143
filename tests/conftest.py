import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reference"))  # fill.py and cases.py, shared with the generator

# No app a test builds in its own process takes Triton's gRPC port 8001 from the machine (running_service gives
# each server a free one)
os.environ["VITSERVE_GRPC_PORT"] = "0"

# Every server a test starts, in its process or in another, runs each model's first CPU plan without measuring the
# others (the quickest start: measuring them costs each start seconds); tests/test_cpu_plans.py measures and pins
os.environ.setdefault("VITSERVE_CPU_PLAN", "first")
