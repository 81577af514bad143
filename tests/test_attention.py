"""Attention maps: the ONNX path against PyTorch, localisation on held-out shapes, and the HTTP endpoints."""
import io
import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from matplotlib import colormaps
from PIL import Image
from service_process import ROOT, photo_bytes, running_service
from skimage import data as photos

import models
from models.data import normalise as torch_normalise
from models.synthetic import sample_rng
from models.synthetic.shapes import render_shape
from repository import graph_inputs
from service.explain.maps import colormap, last_layer_grid, normalise, rollout_grid

REPO, DEMO = ROOT / "model_repository", ROOT / "models" / "demo"
SHAPES = {"shapes-vit": "vit_micro_patch8_96", "shapes-deit": "deit_micro_distilled_patch8_96",
          "shapes-swin": "swin_micro_patch4_window6_96"}


def manifest(name: str) -> dict:
    return json.loads((REPO / name / "manifest.json").read_text())


def torch_model(name: str) -> torch.nn.Module:
    model = models.create_model(SHAPES[name])
    return models.load_weights(model, DEMO / SHAPES[name] / "model.safetensors").eval()


def session(name: str, graph: str = "model.onnx") -> ort.InferenceSession:
    return ort.InferenceSession(REPO / name / graph, providers=["CPUExecutionProvider"])


def off_centre_shapes(count: int, seed: int = 123) -> list:
    """Held-out shapes whose centre is in a corner region: away from the image centre and the diagonals."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        # centre at (24..30, 60..72) or mirrored/transposed: |x - y| >= 30 keeps it off both diagonals' band
        a, b = rng.uniform(22, 30), rng.uniform(62, 74)
        centre = [(a, b), (b, a), (96 - a, 96 - b), (96 - b, 96 - a)][i % 4]
        samples.append(render_shape(sample_rng(seed, i), 96, label=i % 6, centre=centre))
    return samples


def batch_of(samples, spec) -> np.ndarray:
    x = torch.stack([torch.from_numpy(np.asarray(s.image).copy()).permute(2, 0, 1) for s in samples]).float() / 255
    return torch_normalise(x, spec).numpy()


# -- the ONNX path equals PyTorch's explicit attention probabilities ------------------------------------------

@pytest.mark.parametrize("name", ["shapes-vit", "shapes-deit"])
@pytest.mark.parametrize("token", ["cls", "dist", "both"])
def test_vit_maps_equal_pytorch_explicit_attention(name, token):
    m = manifest(name)
    if token != "cls" and "dist" not in m["attention"]["outputs"]:
        pytest.skip("no distillation token")
    model = torch_model(name)
    x = batch_of(off_centre_shapes(4), model.spec)
    main, explain = session(name).run(None, graph_inputs(x)), session(name, "explain.onnx").run(None, graph_inputs(x))
    with torch.no_grad():
        probs = [p.numpy() for p in model.attention_probabilities(torch.from_numpy(x))]  # explicit softmax(QK^T)
    prefix = model.num_prefix_tokens
    rows = {"cls": 0, "dist": 1}
    for i in range(len(x)):
        outputs = dict(zip([o["name"] for o in m["outputs"]], (o[i] for o in main)))
        got = last_layer_grid(outputs, m["attention"], token, "mean")
        tokens = ["cls", "dist"] if token == "both" else [token]
        want = normalise(np.mean([probs[-1][i, :, rows[t], prefix:].mean(0) for t in tokens], 0).reshape(12, 12))
        np.testing.assert_allclose(got, want, atol=1e-4)
        # rollout, written out independently: identity-augmented, row-normalised, multiplied layer by layer
        roll = torch.eye(x.shape[-1] // 8 * x.shape[-1] // 8 + prefix, dtype=torch.float64)
        for p in probs:
            a = 0.5 * torch.from_numpy(p[i]).double().mean(0) + 0.5 * torch.eye(roll.shape[0], dtype=torch.float64)
            roll = (a / a.sum(-1, keepdim=True)) @ roll
        want = normalise(np.mean([roll[rows[t], prefix:].numpy() for t in tokens], 0).reshape(12, 12))
        got = rollout_grid([o[i] for o in explain], m["attention"], token, "mean")
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_swin_map_equals_pytorch_explicit_attention():
    m, model = manifest("shapes-swin"), torch_model("shapes-swin")
    x = batch_of(off_centre_shapes(4), model.spec)
    block = model.layers[-1].blocks[-1]
    seen = {}
    block.norm1.register_forward_hook(lambda mod, args, out: seen.setdefault("tokens", out))
    with torch.no_grad():
        model(torch.from_numpy(x))
        t = seen["tokens"]  # [B, 36, C] token rows: the last stage is one 6 x 6 window, not shifted
        B, N, C = t.shape
        heads = block.attn.num_heads
        qkv = block.attn.qkv(t).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        scores = qkv[0] @ qkv[1].transpose(-2, -1) / (C // heads) ** 0.5 + block.attn.relative_position_bias()
        received = scores.softmax(-1).mean(dim=2)  # [B, heads, 36]: what each token receives, mean over queries
    main = session("shapes-swin").run(None, graph_inputs(x))
    for i in range(B):
        got = last_layer_grid({"attention": main[1][i]}, m["attention"], "cls", "mean")
        np.testing.assert_allclose(got, normalise(received[i].mean(0).numpy().reshape(6, 6)), atol=1e-4)


# -- what the maps show --------------------------------------------------------------------------------------

def peak_and_mass(grid: np.ndarray, box: tuple[int, int, int, int], patch: float) -> tuple[bool, float]:
    """Whether the peak cell lies in the box grown by one patch, and mass-in-box / box-area-share."""
    gh, gw = grid.shape
    cell = 96 / gw
    x, y, w, h = box
    row, col = np.unravel_index(np.argmax(grid), grid.shape)
    cx, cy = (col + 0.5) * cell, (row + 0.5) * cell
    peak_in = x - patch <= cx <= x + w + patch and y - patch <= cy <= y + h + patch
    heat = np.asarray(Image.fromarray(grid.astype(np.float32), mode="F").resize((96, 96), Image.BILINEAR))
    inside = heat[y:y + h, x:x + w].sum() / max(heat.sum(), 1e-12)
    return peak_in, inside / (w * h / 96**2)


@pytest.mark.parametrize("name", ["shapes-vit", "shapes-deit", "shapes-swin"])
def test_maps_find_the_object_and_follow_a_flip(name):
    m = manifest(name)
    samples = off_centre_shapes(120)
    x = np.stack([np.asarray(s.image) for s in samples])  # uint8 pixels, as the service sends them
    outputs = session(name).run(None, graph_inputs(x))
    flipped = session(name).run(None, graph_inputs(np.ascontiguousarray(x[:, :, ::-1])))
    names = [o["name"] for o in m["outputs"]]
    patch = 96 / m["attention"]["grid"][1]
    hits, ratios, flip_hits = [], [], []
    for i, sample in enumerate(samples):
        grid = last_layer_grid(dict(zip(names, (o[i] for o in outputs))), m["attention"], "cls", "mean")
        hit, ratio = peak_and_mass(grid, sample.box, patch)
        hits.append(hit)
        ratios.append(ratio)
        bx, by, bw, bh = sample.box
        flip_grid = last_layer_grid(dict(zip(names, (o[i] for o in flipped))), m["attention"], "cls", "mean")
        flip_hits.append(peak_and_mass(flip_grid, (96 - bx - bw, by, bw, bh), patch)[0])
    print(f"{name}: peak in box {np.mean(hits):.2f}, mass/area median {np.median(ratios):.2f}, "
          f"flipped peak in mirrored box {np.mean(flip_hits):.2f}")
    assert np.mean(hits) >= 0.8
    assert np.median(ratios) >= 2.0
    assert np.mean(flip_hits) >= 0.8


# -- over HTTP -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url():
    with running_service(attention_cache_items=2, attention_ttl_s=30) as base:
        yield base


def classify_with_attention(url: str, data: bytes, model: str = "shapes-deit") -> str:
    r = httpx.post(f"{url}/classify", files={"file": ("p.jpg", data)}, params={"attention": "true", "model": model})
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert result["attention_map_url"] == f"/attention-map?id={result['id']}"
    return result["id"]


def test_map_png_covers_the_upload_at_its_own_size_and_json_has_the_grid(url):
    jpeg = photo_bytes("chelsea", "JPEG")
    key = classify_with_attention(url, jpeg)
    png = httpx.get(f"{url}/attention-map", params={"id": key})
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    # the upload's own size, though the request decoded the JPEG at half size (draft mode) for the 96 px model
    assert Image.open(io.BytesIO(png.content)).size == (451, 300)
    assert Image.open(io.BytesIO(httpx.get(f"{url}/attention-map", params={"id": key, "max_side": 200}).content)
                      ).size == (200, 133)
    body = httpx.get(f"{url}/attention-map", params={"id": key, "format": "json", "token": "both"}).json()
    assert body["grid_size"] == [12, 12] and len(body["grid"]) == 12 and body["image_size"] == [451, 300]
    # the centred square the model saw, in the upload's pixels: columns 24..120 of the photo at 144 x 96
    np.testing.assert_allclose(body["crop_box"], [24 * 451 / 144, 0.0, 120 * 451 / 144, 300.0], atol=1)
    assert max(max(row) for row in body["grid"]) == 1.0
    rollout = httpx.get(f"{url}/attention-map", params={"id": key, "method": "rollout", "format": "json"}).json()
    assert rollout["method"] == "rollout" and rollout["grid"] != body["grid"]


def test_post_attention_map_for_swin_and_clear_errors(url):
    png = photo_bytes("astronaut", "PNG")
    r = httpx.post(f"{url}/attention-map", files={"file": ("a.png", png)},
                   params={"model": "shapes-swin", "format": "json"})
    assert r.status_code == 200 and r.json()["grid_size"] == [6, 6] and r.json()["token"] is None
    assert r.json()["prediction"]["label"] in manifest("shapes-swin")["labels"]
    errors = [
        (httpx.post(f"{url}/attention-map", files={"file": ("a.png", png)},
                    params={"model": "shapes-swin", "method": "rollout"}), 400, "rollout_unavailable"),
        (httpx.post(f"{url}/attention-map", files={"file": ("a.png", png)},
                    params={"model": "shapes-vit", "token": "dist"}),
         400, "bad_token"),
        (httpx.post(f"{url}/attention-map", files={"file": ("a.png", png)}, params={"head": "9"}), 400, "bad_head"),
        (httpx.post(f"{url}/attention-map", files={"file": ("a.png", png)}, params={"colormap": "rainbow"}),
         400, "bad_colormap"),
        (httpx.get(f"{url}/attention-map", params={"id": "0" * 32}), 404, "attention_not_found"),
    ]
    for response, status, code in errors:
        assert response.status_code == status and response.json()["error"]["code"] == code, response.text


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])  # a PNG decoded whole; a JPEG reduced for the model, then again
def test_a_large_uploads_map_is_bounded_in_pixels(url, fmt):
    big = Image.fromarray(photos.astronaut()).resize((3000, 2000))
    buf = io.BytesIO()
    big.save(buf, format=fmt, **({"compress_level": 1} if fmt == "PNG" else {}))
    for params, side in (({}, 1024), ({"max_side": 300}, 300), ({"max_side": 8192}, 3000)):
        r = httpx.post(f"{url}/attention-map", files={"file": ("big", buf.getvalue())}, params=params, timeout=60)
        assert r.status_code == 200, r.text
        assert Image.open(io.BytesIO(r.content)).size == (side, round(side * 2 / 3))


def test_cache_is_bounded_and_evicted_ids_get_a_clear_404(url):
    # the two-item cache drops the oldest id; expiry by age is test_service_units.py's
    jpeg = photo_bytes("coffee", "JPEG")
    first, second, third = (classify_with_attention(url, jpeg) for _ in range(3))
    gone = httpx.get(f"{url}/attention-map", params={"id": first})
    assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
    assert httpx.get(f"{url}/attention-map", params={"id": third}).status_code == 200


def test_colormaps_match_matplotlib():
    for name in ("jet", "viridis", "inferno", "turbo"):
        ours = colormap(name).astype(float) / 255
        theirs = np.array([colormaps[name](i / 255)[:3] for i in range(256)])
        np.testing.assert_allclose(ours, theirs, atol=1 / 255)
