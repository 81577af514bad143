"""Peer "triton": Triton Inference Server through PyTriton (its wheel bundles tritonserver, with Triton's own HTTP
front end and dynamic batcher), two Python models over one ONNX Runtime session, each batching up to 16 requests
for at most 5 ms:

    shapes-deit       input `images` UINT8 [-1, 96, 96, 3], outputs the graph's (logits and attention), as vitserve's
                      /v2 answers; the KServe v2 binary tensor extension carries them.
    shapes-deit-jpeg  input `jpeg` BYTES [-1, 1], one encoded image per row (Triton's HTTP front end takes tensors,
                      not multipart uploads), decoded and preprocessed in the model; outputs top-1 label, index, score.

    python bench/peers/triton_server.py HTTP_PORT GRPC_PORT METRICS_PORT   # nvidia-pytriton, numpy<2, onnxruntime
"""
import signal
import sys

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

import common

session = common.session()
BATCHING = ModelConfig(max_batch_size=16, batcher=DynamicBatcher(max_queue_delay_microseconds=5000))


@batch
def infer_images(images: np.ndarray) -> dict[str, np.ndarray]:
    return dict(zip(common.OUTPUTS, common.run(session, images)))


@batch
def infer_jpeg(jpeg: np.ndarray) -> dict[str, np.ndarray]:
    logits = common.run(session, np.stack([common.preprocess(row[0]) for row in jpeg]))[0]
    best = [common.top1(row) for row in logits]
    return {"label": np.array([[b["label"].encode()] for b in best], dtype=object),
            "index": np.array([[b["index"]] for b in best], dtype=np.int64),
            "score": np.array([[b["score"]] for b in best], dtype=np.float32)}


def main() -> None:
    http, grpc, metrics = map(int, sys.argv[1:4])
    # SIGTERM as Ctrl-C, so that leaving the `with` stops tritonserver too
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    h, w = common.POLICY.size
    shapes = {o["name"]: tuple(o["shape"][1:]) for o in common.ENTRY.manifest["outputs"]}
    config = TritonConfig(http_address="127.0.0.1", http_port=http, grpc_address="127.0.0.1", grpc_port=grpc,
                          metrics_address="127.0.0.1", metrics_port=metrics)
    with Triton(config=config) as triton:
        triton.bind(model_name="shapes-deit", infer_func=infer_images,
                    inputs=[Tensor(name="images", dtype=np.uint8, shape=(h, w, 3))],
                    outputs=[Tensor(name=n, dtype=np.float32, shape=shapes[n]) for n in common.OUTPUTS],
                    config=BATCHING)
        triton.bind(model_name="shapes-deit-jpeg", infer_func=infer_jpeg,
                    inputs=[Tensor(name="jpeg", dtype=np.bytes_, shape=(1,))],
                    outputs=[Tensor(name="label", dtype=np.bytes_, shape=(1,)),
                             Tensor(name="index", dtype=np.int64, shape=(1,)),
                             Tensor(name="score", dtype=np.float32, shape=(1,))],
                    config=BATCHING)
        triton.serve()


if __name__ == "__main__":
    main()
