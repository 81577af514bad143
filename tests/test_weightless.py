"""Graphs staged for a GPU host without their weights (bench/weightless.py), on an embedded Swin: what travels, what
ONNX Runtime makes of it before and after the new weights, and what is kept exactly."""
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from service_process import ROOT, model_pixels, photo_bytes, run_graph

from bench.weightless import SIDECAR, refill_all, strip_all
from repository import read_entry, verify_file


def tensors(graph) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(graph).graph.initializer}


def test_a_graph_travels_without_its_weights_and_runs_on_new_ones_of_the_same_spread(tmp_path):
    folder = tmp_path / "shapes-swin"
    shutil.copytree(ROOT / "model_repository" / "shapes-swin", folder)
    graph, pixels = folder / "model.onnx", model_pixels(folder, photo_bytes("chelsea", "JPEG"))[None]
    before, want = tensors(graph), run_graph(graph, pixels)[0]

    strip_all(tmp_path)
    strip_all(tmp_path)  # a stripped graph is left as it is
    assert graph.stat().st_size < (ROOT / "model_repository" / "shapes-swin" / "model.onnx").stat().st_size / 5
    with pytest.raises(Exception, match="does not match expected count"):  # never timed empty by mistake
        ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])

    # the CPU plans' graph and the relevance graph travel the same way
    int8, relevance = folder / "model.int8.onnx", folder / "relevance.onnx"
    assert sorted(refill_all(tmp_path)) == sorted([graph, int8, relevance])
    assert not list(tmp_path.rglob("*" + SIDECAR)) and refill_all(tmp_path) == []
    for file in ("model", "model_int8", "relevance"):
        verify_file(read_entry(folder), file)  # the manifest's sha256 follows the new weights
    after = tensors(graph)
    assert after.keys() == before.keys()
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert len(changed) >= 10
    for name in changed:  # weights: as many, of the same type and spread
        old, new = before[name], after[name]
        assert new.shape == old.shape and new.dtype == old.dtype and old.size >= 1 << 14
        assert new.std() == pytest.approx(old.std(), rel=0.05)
        assert abs(new.mean() - old.mean()) < 0.05 * old.std() + 1e-6
    assert "model.layers.0.blocks.1.attn.attn_mask" not in changed  # few distinct values: kept as they mean

    got = run_graph(graph, pixels)[0]
    assert got.shape == want.shape and np.isfinite(got).all() and not np.allclose(got, want)
