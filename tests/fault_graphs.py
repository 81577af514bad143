"""Copies of a model whose graph misbehaves inside ONNX Runtime's run on a condition its input sets: a batch holding
an image whose top-left input pixel is 128 or brighter. `fragile` fails such a batch (a real error of ONNX
Runtime's, Gather out of bounds); `stalling` makes it last (a Loop): for ever by default, as a wedged kernel would,
while the process's event loop runs on, or about as long as asked on this host (`turns_for`), whatever its speed.
Darker images get the source model's own answers, as fast."""
import json
import shutil
import time
from pathlib import Path

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from service_process import model_pixels, photo_bytes

from repository import graph_inputs, sha256

BRIGHT_FROM = 128  # the top-left pixel value from which a batch fails (or stalls)
_CORNER = [
    helper.make_tensor("zeros4", TensorProto.INT64, [4], [0, 0, 0, 0]),
    helper.make_tensor("ones3", TensorProto.INT64, [4], [2**62, 1, 1, 1]),
]


def fragile(source: Path, target: Path) -> None:
    """That pixel indexes a 128-entry table (Gather fails out of bounds), and adds 0 to the logits."""
    _rewrite(source, target, [
        helper.make_tensor("table", TensorProto.FLOAT, [BRIGHT_FROM], [0.0] * BRIGHT_FROM),
        helper.make_tensor("column", TensorProto.INT64, [2], [-1, 1])], [
        helper.make_node("Cast", ["corner"], ["index"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["index", "column"], ["indices"]),
        helper.make_node("Gather", ["table", "indices"], ["nothing"])])


def stalling(source: Path, target: Path, turns: int = 2**62) -> None:
    """A Loop turns `turns` times where the batch's brightest such pixel is 128 or more (else none), counting; 0
    times its count is added to the logits."""
    scalar = []
    body = helper.make_graph(
        [helper.make_node("Identity", ["going"], ["going_on"]),
         helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one_value", TensorProto.FLOAT, [], [1.0])),
         helper.make_node("Add", ["count", "one"], ["counted"])],
        "turn",
        [helper.make_tensor_value_info("turn", TensorProto.INT64, scalar),
         helper.make_tensor_value_info("going", TensorProto.BOOL, scalar),
         helper.make_tensor_value_info("count", TensorProto.FLOAT, scalar)],
        [helper.make_tensor_value_info("going_on", TensorProto.BOOL, scalar),
         helper.make_tensor_value_info("counted", TensorProto.FLOAT, scalar)])
    _rewrite(source, target, [
        helper.make_tensor("threshold", TensorProto.FLOAT, [], [BRIGHT_FROM - 0.5]),
        helper.make_tensor("many", TensorProto.INT64, [], [turns]),
        helper.make_tensor("never", TensorProto.INT64, [], [0]),
        helper.make_tensor("go", TensorProto.BOOL, [], [True]),
        helper.make_tensor("start", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])], [
        helper.make_node("Cast", ["corner"], ["corner_float"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", ["corner_float"], ["brightest"], keepdims=0),
        helper.make_node("Greater", ["brightest", "threshold"], ["bright"]),
        helper.make_node("Where", ["bright", "many", "never"], ["turns"]),
        helper.make_node("Loop", ["turns", "go", "start"], ["count"], body=body),
        helper.make_node("Mul", ["count", "zero"], ["nothing"])])


def turns_for(seconds: float, source: Path, folder: Path) -> int:
    """The Loop turns that make a bright batch of `source`'s stalling copy last at least about `seconds` on this
    host, on one thread as the servers of the tests run it: the fastest of three runs of a trial copy (written under
    `folder`) sets the pace."""
    trial, trial_turns = folder / "trial", 200_000
    stalling(source, trial, trial_turns)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(trial / "model.onnx", options, providers=["CPUExecutionProvider"])
    feed = graph_inputs(model_pixels(source, photo_bytes("astronaut", "JPEG"))[None])  # top-left pixel 168
    paces = []
    for _ in range(3):
        start = time.perf_counter()
        session.run(None, feed)
        paces.append((time.perf_counter() - start) / trial_turns)
    shutil.rmtree(trial)
    return int(seconds / min(paces))


def _rewrite(source: Path, target: Path, initializers: list, nodes: list) -> None:
    """`source` copied to `target` (its own name) with `nodes` computing "nothing" from "corner" (the images' top-left
    pixels), added to the logits."""
    shutil.copytree(source, target)
    graph = onnx.load(target / "model.onnx")
    for node in graph.graph.node:
        node.output[:] = ["logits_before" if o == "logits" else o for o in node.output]
    graph.graph.initializer.extend(_CORNER + initializers)
    graph.graph.node.extend([helper.make_node("Slice", ["images", "zeros4", "ones3"], ["corner"]), *nodes,
                             helper.make_node("Add", ["logits_before", "nothing"], ["logits"])])
    onnx.save(graph, target / "model.onnx")
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["name"] = target.name
    graph_file = target / "model.onnx"
    manifest["files"]["model"].update(sha256=sha256(graph_file), bytes=graph_file.stat().st_size)
    (target / "manifest.json").write_text(json.dumps(manifest))
