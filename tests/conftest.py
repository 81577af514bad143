import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reference"))  # fill.py and cases.py, shared with the generator

# No app a test builds in its own process takes Triton's gRPC port 8001 from the machine (running_service gives
# each server a free one)
os.environ["VITSERVE_GRPC_PORT"] = "0"
