"""The Open Inference Protocol (KServe v2, Triton's): model metadata and configuration, gRPC, Triton's statistics, and
the protobuf code generated from open_inference.proto (`make proto`).

Imports core, engine and pipeline; never the web stack (http).
"""
