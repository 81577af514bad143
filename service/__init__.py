"""The vitserve inference service: FastAPI + ONNX Runtime over a model repository. No torch in here."""
