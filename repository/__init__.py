"""The model repository contract: one folder per model with manifest.json and the ONNX graphs it lists.

Shared by the exporter (which writes it) and the service (which reads it); imports neither torch nor the web
stack, and raises RepositoryError, which each side reports in its own way.
"""
from .entries import (FACE_DETECTION, ModelEntry, RepositoryError, face_detector, find_entries, model_manifests,
                      read_entry, scan, servable, sha256, validate_manifest, verify_file, version_policy, versions)
from .policy import InputPolicy, graph_inputs

__all__ = ["FACE_DETECTION", "InputPolicy", "ModelEntry", "RepositoryError", "face_detector", "find_entries",
           "graph_inputs", "model_manifests", "read_entry", "scan", "servable", "sha256",
           "validate_manifest", "verify_file", "version_policy", "versions"]
