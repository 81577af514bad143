"""Export registry models to verified ONNX model-repository entries (`python -m export --help`)."""
