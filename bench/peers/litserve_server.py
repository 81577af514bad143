"""Peer "litserve": LitServe's batching server. decode_request turns the multipart upload into the model's uint8
input, batches of up to 16 gather for at most 5 ms, predict runs the stacked batch on one ONNX Runtime session,
encode_response gives each image's top-1. LitServe's defaults otherwise: one API server process and one
inference worker process, which decodes each request of a batch before running it.

    python bench/peers/litserve_server.py PORT   # litserve, python-multipart, onnxruntime
"""
import sys

import litserve as ls
import numpy as np

import common


class ShapesAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.session = common.session()

    def decode_request(self, request) -> np.ndarray:  # the parsed form: request["file"] is an UploadFile
        return common.preprocess(request["file"].file.read())

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)

    def predict(self, images: np.ndarray) -> np.ndarray:
        return common.run(self.session, images)[0]

    def unbatch(self, logits: np.ndarray) -> list[np.ndarray]:
        return list(logits)

    def encode_response(self, logits: np.ndarray) -> dict:
        return common.top1(logits)


if __name__ == "__main__":  # LitServe starts its workers with spawn: they import this file again
    api = ShapesAPI(max_batch_size=16, batch_timeout=0.005, api_path="/classify")
    ls.LitServer(api, accelerator="cpu").run(host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                                             generate_client_file=False)
