"""MTCNN's three nets (models/mtcnn.py) with the committed weights: facenet-pytorch's own outputs, a face found in a
real photograph, and their export into the face detector the service uses."""
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from face_scenes import ASTRONAUT_FACE
from safetensors.torch import load_file
from service_process import ROOT
from skimage import data as photos

from export.__main__ import main as export_main
from models.mtcnn import PRETRAINED, create_mtcnn
from repository import face_detector, read_entry

REFERENCE = ROOT / "tests" / "reference" / "mtcnn_reference.safetensors"


@pytest.fixture(scope="module")
def nets():
    return create_mtcnn()


def test_the_nets_have_the_papers_sizes_and_the_licence_travels_with_the_weights(nets):
    assert {name: sum(p.numel() for p in net.parameters()) for name, net in nets.items()} == {
        "pnet": 6_632, "rnet": 100_178, "onet": 389_040}
    assert "MIT License" in PRETRAINED.with_name("mtcnn.LICENSE.md").read_text()


def test_the_committed_weights_give_facenet_pytorchs_own_outputs(nets):
    """Recorded from facenet-pytorch 2.6.0's nets by tests/reference/make_mtcnn_reference.py."""
    ref = load_file(REFERENCE)
    with torch.no_grad():
        got = dict(zip(("pnet_box", "pnet_prob"), nets["pnet"](ref["pnet_in"])))
        got.update(zip(("rnet_box", "rnet_prob"), nets["rnet"](ref["rnet_in"])))
        got.update(zip(("onet_box", "onet_landmarks", "onet_prob"), nets["onet"](ref["onet_in"])))
    for name, value in got.items():
        torch.testing.assert_close(value, ref[name], atol=1e-6, rtol=0, msg=name)


def test_pnet_finds_the_astronauts_face(nets):
    """The photo at 64 x 64, where her face is about P-Net's window of 12 pixels: its likeliest window (stride 2)
    is her face."""
    scale = 64 / 512
    pixels = np.asarray(Image.fromarray(photos.astronaut()).resize((64, 64), Image.BILINEAR), np.float32)
    with torch.no_grad():
        _, prob = nets["pnet"](torch.from_numpy((pixels - 127.5) / 128).permute(2, 0, 1)[None])
    face = prob[0, 1]
    y, x = divmod(int(face.argmax()), face.shape[1])
    x0, y0, x1, y1 = np.array([x * 2, y * 2, x * 2 + 12, y * 2 + 12]) / scale
    fx, fy, fw, fh = ASTRONAUT_FACE
    overlap = max(0, min(x1, fx + fw) - max(x0, fx)) * max(0, min(y1, fy + fh) - max(y0, fy))
    assert float(face.max()) > 0.99 and overlap / ((x1 - x0) * (y1 - y0) + fw * fh - overlap) >= 0.5


def test_the_export_writes_the_embedded_detector_byte_for_byte_and_its_graphs_match_pytorch(nets, tmp_path):
    """`python -m export mtcnn`: three graphs equal to the committed ones, a manifest the repository validates,
    P-Net at any height and width and R-Net and O-Net at any batch, as PyTorch computes them."""
    export_main(["mtcnn", "--out", str(tmp_path)])
    entry, problem = face_detector(tmp_path)
    assert problem is None and entry.task == "face-detection"
    committed = read_entry(ROOT / "model_repository" / "mtcnn").manifest["files"]
    assert entry.manifest["files"] == committed  # sha256 included: the embedded detector is this export's
    rng = np.random.default_rng(0)
    for net, shapes in {"pnet": [(1, 12, 12), (1, 77, 130)], "rnet": [(1, 24, 24), (5, 24, 24)],
                        "onet": [(1, 48, 48), (3, 48, 48)]}.items():
        session = ort.InferenceSession(entry.path(net), providers=["CPUExecutionProvider"])
        for shape in shapes:
            pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
            got = session.run(None, {"images": pixels})
            with torch.no_grad():
                *want, probs = nets[net]((torch.from_numpy(pixels).permute(0, 3, 1, 2).float() - 127.5) / 128)
            for g, w in zip(got, [*want, probs[:, 1]]):
                np.testing.assert_allclose(g, w.numpy(), atol=1e-5, err_msg=f"{net} {shape}")
