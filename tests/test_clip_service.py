"""A whole CLIP served (issue 76): zero-shot POST /classify?labels=... scores as transformers' CLIPModel scores,
POST /v1/embeddings answers as OpenAI's API answers (the official `openai` client against it) with the text vectors
of get_text_features and the image vectors of /embed, texts of several requests batch together, and every hostile
input is a 4xx that leaves the server serving. A real server on a loopback port, on an exported tiny CLIP folder
(tests/clip_folder.py) beside a demo classifier, under both backends."""
import base64
import functools
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from clip_folder import CONTEXT, save_clip_folder
from PIL import Image
from tritonclient.utils import InferenceServerException
from service_process import ROOT, children, free_port, metric, photo_bytes, service_and_process, write_model

from export.__main__ import main as export_main

ATOL = 1e-4
PHOTOS = {name: photo_bytes(name, "JPEG", quality=90) for name in ("chelsea", "astronaut", "coffee")}
LABEL_SETS = [["cat", "astronaut", "coffee"], ["tabby cat", "tiger cat", "Egyptian cat", "lynx", "dog"],
              ["a rocket", "a cup of coffee"]]
TEXTS = ["a photo of a cat", "dog", "A much longer sentence, with punctuation: it's here!", "crème brûlée 🐱",
         "word " * 60]  # the last past the context: cut, as transformers cuts it
AVIF_BOMB = (ROOT / "tests" / "reference" / "flat_12000.avif").read_bytes()  # 144 MP, its header says 64 x 64


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> tuple[Path, Path]:
    """(the CLIP folder, a repository holding it exported as `clip`, and shapes-vit, a classifier)."""
    root = tmp_path_factory.mktemp("clip-service")
    save_clip_folder(root / "clip")
    export_main([str(root / "clip"), "--out", str(root / "repository"), "--no-explain"])
    write_model(root / "repository" / "shapes-vit", ROOT / "model_repository" / "shapes-vit", "shapes-vit")
    return root / "clip", root / "repository"


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, clip) -> tuple[str, list[int], str]:
    """(the URL, the service's process ids, its gRPC address) of a server on the repository, under either
    backend."""
    settings = {"backend": request.param, "workers": 1} if request.param == "process" else {}
    port = free_port()
    with service_and_process(model_repository=clip[1], default_model="clip", max_queue_delay_ms=20, grpc_port=port,
                             **settings) as (url, proc):
        yield url, [proc.pid, *children(proc.pid)], f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def reference(clip):
    folder = clip[0]
    return (transformers.CLIPModel.from_pretrained(folder).eval(), transformers.CLIPTokenizer.from_pretrained(folder),
            transformers.CLIPImageProcessor.from_pretrained(folder))


def text_features(reference, texts: list[str]) -> np.ndarray:
    model, tokenizer, _ = reference
    with torch.no_grad():
        inputs = tokenizer(texts, padding=True, truncation=True, max_length=CONTEXT, return_tensors="pt")
        return model.get_text_features(**inputs).pooler_output.numpy()


def unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def embeddings(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)


def vectors_of(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data))) and {d["object"] for d in data} == {"embedding"}
    return np.array([d["embedding"] if isinstance(d["embedding"], list)
                     else np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data], np.float32)


def data_url(image: bytes, media: str = "image/jpeg") -> str:
    return f"data:{media};base64,{base64.b64encode(image).decode()}"


def classify(url: str, images: list[bytes], labels: list[str] | None = None, form: bool = False,
             **params) -> httpx.Response:
    files = [("files", (f"{i}.jpg", image)) for i, image in enumerate(images)]
    if form:
        files += [("labels", (None, label.encode())) for label in labels or []]
    elif labels is not None:
        params["labels"] = labels
    return httpx.post(f"{url}/classify", files=files, params=params, timeout=60)


def serves(url: str) -> None:
    assert classify(url, [PHOTOS["chelsea"]], ["cat", "dog"]).status_code == 200
    assert embeddings(url, input="still here").status_code == 200


@pytest.mark.parametrize("labels", LABEL_SETS, ids=lambda labels: f"{len(labels)}-labels")
def test_zero_shot_scores_are_clipmodels_softmax_of_the_same_prompts(server, reference, labels):
    """Each photo's scores over the labels, in the query and in the form alike, equal logits_per_image.softmax
    of transformers' CLIPModel on its processor's pixels of the same JPEGs and the model's default prompts."""
    url, *_ = server
    model, tokenizer, processor = reference
    listed = {m["name"]: m for m in httpx.get(f"{url}/models", timeout=10).json()["models"]}
    text = listed["clip"]["text"]
    assert text["scores"] == "softmax" and listed["shapes-vit"]["text"] is None
    photos = [Image.open(io.BytesIO(jpeg)).convert("RGB") for jpeg in PHOTOS.values()]
    inputs = transformers.CLIPProcessor(processor, tokenizer)(
        text=[text["template"].format(label) for label in labels], images=photos, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model(**inputs).logits_per_image.softmax(-1).numpy()
    for form in (False, True):
        answer = classify(url, list(PHOTOS.values()), labels, form=form, top_k=100)
        assert answer.status_code == 200, answer.text
        assert answer.json()["scores"] == "softmax"
        for row, result in zip(want, answer.json()["results"]):
            predictions = result["predictions"]
            assert [p["label"] for p in predictions] == [labels[i] for i in np.argsort(-row, kind="stable")]
            assert all(labels[p["index"]] == p["label"] for p in predictions)
            np.testing.assert_allclose([p["score"] for p in predictions], np.sort(row)[::-1], atol=ATOL, rtol=0)
    top = classify(url, [PHOTOS["chelsea"]], labels, top_k=1).json()["results"][0]["predictions"]
    assert len(top) == 1 and top[0]["label"] == labels[int(want[0].argmax())]


def test_a_template_of_the_request_makes_the_prompts(server, reference):
    url, *_ = server
    model, tokenizer, processor = reference
    labels, template = ["cat", "rocket", "cup"], "an image showing {}, in close-up"
    inputs = transformers.CLIPProcessor(processor, tokenizer)(
        text=[template.format(label) for label in labels], images=[Image.open(io.BytesIO(PHOTOS["coffee"]))],
        return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model(**inputs).logits_per_image.softmax(-1).numpy()[0]
    answer = classify(url, [PHOTOS["coffee"]], labels, template=template)
    assert answer.status_code == 200, answer.text
    got = {p["label"]: p["score"] for p in answer.json()["results"][0]["predictions"]}
    np.testing.assert_allclose([got[label] for label in labels], want, atol=ATOL, rtol=0)


def test_text_embeddings_are_get_text_features_unit_length(server, reference):
    """OpenAI's answer: a list of unit vectors (float or base64), transformers' get_text_features normalised;
    `dimensions` keeps the first that many, unit length again; usage counts the texts' tokens."""
    url, *_ = server
    want = unit(text_features(reference, TEXTS))
    answer = embeddings(url, model="clip", input=TEXTS)
    got = vectors_of(answer)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    body = answer.json()
    assert body["object"] == "list" and body["model"] == "clip"
    tokens = sum(len(ids) for ids in reference[1](TEXTS, truncation=True, max_length=CONTEXT)["input_ids"])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    np.testing.assert_allclose(vectors_of(embeddings(url, model="clip", input=TEXTS, encoding_format="base64")),
                               got, atol=1e-7, rtol=0)
    np.testing.assert_allclose(vectors_of(embeddings(url, model="clip", input=TEXTS[0])), got[:1], atol=1e-6)
    short = vectors_of(embeddings(url, model="clip", input=TEXTS, dimensions=5))
    np.testing.assert_allclose(short, unit(want[:, :5]), atol=ATOL, rtol=0)
    many = [f"{i} " + TEXTS[i % len(TEXTS)] for i in range(2048)]  # OpenAI's limit, past the queue's 256
    np.testing.assert_allclose(vectors_of(embeddings(url, model="clip", input=many))[::97],
                               unit(text_features(reference, many[::97])), atol=ATOL, rtol=0)


def test_images_as_data_urls_are_embeds_vectors_in_the_texts_space(server, reference):
    """A data-URL image beside texts: its vector is /embed's (normalised), and its cosine with a text's is
    CLIPModel's own logits_per_text / logit_scale."""
    url, *_ = server
    model, tokenizer, processor = reference
    photos = list(PHOTOS.values())
    answer = embeddings(url, model="clip", input=[TEXTS[0], data_url(photos[0]), data_url(photos[1]), TEXTS[1]])
    got = vectors_of(answer)
    assert answer.json()["usage"]["prompt_tokens"] == sum(
        len(ids) for ids in tokenizer(TEXTS[:2])["input_ids"])  # images count no tokens
    embedded = httpx.post(f"{url}/embed", files=[("files", ("a.jpg", p)) for p in photos[:2]],
                          params={"model": "clip"}, timeout=60).json()["results"]
    np.testing.assert_allclose(got[1:3], [r["embedding"] for r in embedded], atol=1e-6, rtol=0)
    inputs = transformers.CLIPProcessor(processor, tokenizer)(
        text=TEXTS[:2], images=[Image.open(io.BytesIO(p)).convert("RGB") for p in photos[:2]], return_tensors="pt",
        padding=True)
    with torch.no_grad():
        cosines = (model(**inputs).logits_per_image / model.logit_scale.exp()).numpy()
    np.testing.assert_allclose(got[1:3] @ got[[0, 3]].T, cosines, atol=ATOL, rtol=0)
    png = vectors_of(embeddings(url, model="shapes-vit", input=data_url(photo_bytes("astronaut", "PNG"), "image/png")))
    assert png.shape == (1, 128) and abs(np.linalg.norm(png) - 1) < 1e-5  # any model with an embedding output


def test_the_openai_client_embeds_unchanged(server, reference):
    url, *_ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model="clip", input=TEXTS[:3])
    np.testing.assert_allclose([d.embedding for d in answer.data], unit(text_features(reference, TEXTS[:3])),
                               atol=ATOL, rtol=0)
    assert answer.usage.total_tokens > 0
    # the client's own default: base64, which it decodes
    assert len(client.embeddings.create(model="clip", input="a cat").data[0].embedding) == 16
    with pytest.raises(openai.BadRequestError, match="never fetches") as refused:
        client.embeddings.create(model="clip", input="https://example.com/cat.jpg")
    assert refused.value.code == "url_input"  # the client reads our error as OpenAI's


def test_texts_of_several_requests_batch_together_each_as_if_alone(server):
    """Texts of 24 requests at once, of every length: each request's vectors are its own as when it ran alone,
    and fewer text batches ran than requests."""
    url, *_ = server
    texts = [[f"{'tiny ' * (i % 7)}photo number {i}", "dog" * (i % 3 + 1)] for i in range(24)]
    alone = [vectors_of(embeddings(url, model="clip", input=t)) for t in texts]
    before = texts_run(url)
    with ThreadPoolExecutor(24) as pool:
        together = list(pool.map(lambda t: vectors_of(embeddings(url, model="clip", input=t)), texts))
    after = texts_run(url)
    for a, b in zip(alone, together):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    assert after - before == 48  # every text ran, once


def texts_run(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, "vitserve_images_total", model="clip:text")


def top_scores(answer: httpx.Response) -> dict[str, float]:
    return {p["label"]: p["score"] for p in answer.json()["results"][0]["predictions"]}


def test_labels_seen_before_cost_no_text_run(server):
    url, *_ = server
    labels = ["zebra", "giraffe", "okapi"]
    count = functools.partial(texts_run, url)
    start = count()
    first = classify(url, [PHOTOS["chelsea"]], labels)
    ran = count()
    again = classify(url, [PHOTOS["chelsea"]], [*labels[::-1], "tapir"])
    assert first.status_code == again.status_code == 200
    assert (ran - start, count() - ran) == (3, 1)  # only the new label's prompt ran
    assert top_scores(again)["zebra"] < top_scores(first)["zebra"]  # a fourth label shares the softmax


def v2_texts(client, texts: list[str] | np.ndarray, binary: bool = True, model: str = "clip",
             shape: list[int] | None = None) -> np.ndarray:
    """The texts' embeddings over /v2 (tritonclient, REST or gRPC): the `text` BYTES input, `text_embeds` out."""
    module = triton_http if isinstance(client, triton_http.InferenceServerClient) else triton_grpc
    values = np.array([t.encode() if isinstance(t, str) else t for t in texts], dtype=np.object_)
    tensor = module.InferInput("text", shape or [len(values)], "BYTES")
    if module is triton_http:
        tensor.set_data_from_numpy(values.reshape(shape or [len(values)]), binary_data=binary)
    else:
        tensor.set_data_from_numpy(values.reshape(shape or [len(values)]))
    return client.infer(model, [tensor]).as_numpy("text_embeds")


def test_tritonclient_embeds_texts_over_v2_as_get_text_features(server, reference):
    """The `text` BYTES input (Triton's string tensor), binary or JSON over REST and over gRPC, [B] or [B, 1]:
    `text_embeds` is get_text_features (not normalised, as /v2's image embeddings are not); the metadata lists it."""
    url, _, grpc_address = server
    want = text_features(reference, TEXTS)
    rest = triton_http.InferenceServerClient(url.removeprefix("http://"))
    meta = rest.get_model_metadata("clip")
    assert meta["parameters"]["text"]["input"] == {"name": "text", "datatype": "BYTES", "shape": [-1]}
    assert meta["parameters"]["text"]["outputs"][0] == {"name": "text_embeds", "datatype": "FP32", "shape": [-1, 16]}
    for binary in (True, False):
        np.testing.assert_allclose(v2_texts(rest, TEXTS, binary), want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(v2_texts(rest, TEXTS, shape=[len(TEXTS), 1]), want, atol=ATOL, rtol=0)
    with triton_grpc.InferenceServerClient(grpc_address) as client:
        np.testing.assert_allclose(v2_texts(client, TEXTS), want, atol=ATOL, rtol=0)
        with pytest.raises(InferenceServerException, match="element 1 is not UTF-8"):
            v2_texts(client, ["fine", b"\xff\xfe"])
    raw = httpx.post(f"{url}/v2/models/clip/infer", timeout=30, json={
        "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a photo of a cat", "dog"]}]})
    assert raw.status_code == 200, raw.text
    np.testing.assert_allclose(np.array(raw.json()["outputs"][0]["data"]).reshape(2, 16), want[:2], atol=ATOL)


def v2_hostile(url: str) -> list[tuple[str, httpx.Response, str]]:
    """(what, the answer, words its error holds) of /v2 text requests that must be 400s."""
    def post(inputs: list[dict], body: bytes = b"", outputs: list | None = None) -> httpx.Response:
        header = json.dumps({"inputs": inputs, **({"outputs": outputs} if outputs else {})}).encode()
        return httpx.post(f"{url}/v2/models/clip/infer", content=header + body, timeout=30,
                          headers={"Inference-Header-Content-Length": str(len(header))} if body else {})
    text = {"name": "text", "datatype": "BYTES"}
    photo = np.zeros((1, 32, 32, 3), np.uint8)
    image = {"name": "images", "shape": [1, 32, 32, 3], "datatype": "UINT8", "data": photo.ravel().tolist()}
    return [
        ("text beside images", post([{**text, "shape": [1], "data": ["a"]}, image]), "takes no other input"),
        ("text as FP32", post([{"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}]), "BYTES [-1]"),
        ("a shape of 3 dims", post([{**text, "shape": [1, 1, 1], "data": ["a"]}]), "BYTES [-1]"),
        ("shape 0", post([{**text, "shape": [0], "data": []}]), "BYTES [-1]"),
        ("fewer elements than the shape", post([{**text, "shape": [3], "data": ["a", "b"]}]), "2 elements"),
        ("numbers for strings", post([{**text, "shape": [2], "data": [1, 2]}]), "not a list of strings"),
        ("no data", post([{**text, "shape": [1]}]), "not a list of strings"),
        ("a lone surrogate", post([{**text, "shape": [1], "data": ["\ud800"]}]), "Invalid JSON"),  # (no UTF-8)
        ("an empty string", post([{**text, "shape": [1], "data": [""]}]), "empty"),
        ("a NUL", post([{**text, "shape": [1], "data": ["a\u0000b"]}]), "U+0000"),
        ("a length past the end", post([{**text, "shape": [1], "parameters": {"binary_data_size": 6}}],
                                       (100).to_bytes(4, "little") + b"ab"), "says 100 bytes"),
        ("a cut length", post([{**text, "shape": [2], "parameters": {"binary_data_size": 7}}],
                              (1).to_bytes(4, "little") + b"a" + b"\x00\x00"), "no 4-byte length"),
        ("an unknown output", post([{**text, "shape": [1], "data": ["a"]}], outputs=[{"name": "logits"}]),
         "no output 'logits'"),
        ("text in shared memory", post([{**text, "shape": [1], "parameters": {
            "shared_memory_region": "r", "shared_memory_byte_size": 5}}]), "send the texts in the request"),
        ("text of a model without a text tower", httpx.post(f"{url}/v2/models/shapes-vit/infer", timeout=30, json={
            "inputs": [{**text, "shape": [1], "data": ["a"]}]}), "this model takes"),
    ]


def test_hostile_v2_texts_are_400s_naming_the_fault(server):
    url, *_ = server
    for what, answer, words in v2_hostile(url):
        assert answer.status_code == 400, (what, answer.text)
        assert words in answer.json()["error"], (what, answer.json())
    serves(url)


def hostile_cases(url: str) -> list[tuple[str, httpx.Response, int, str]]:
    """(what, the answer, the status it must have, its error code)."""
    photo = [PHOTOS["chelsea"]]
    label_cases = [
        ("no labels (form, empty)", classify(url, photo, [""], form=True), 400, "empty_label"),
        ("one label", classify(url, photo, ["cat"]), 400, "too_few_labels"),
        ("a label twice", classify(url, photo, ["cat", "dog", "cat"]), 400, "duplicate_label"),
        ("10,000 labels", classify(url, photo, [f"label {i}" for i in range(10_000)], form=True), 413,
         "too_many_labels"),
        ("a 1 MB label", classify(url, photo, ["cat", "x" * 2**20], form=True), 413, "label_too_long"),
        ("a NUL in a label", classify(url, photo, ["cat", "d\x00g"]), 400, "control_character"),
        ("an escape in a label", classify(url, photo, ["cat", "\x1b[31mdog"], form=True), 400, "control_character"),
        ("a label not UTF-8, query", httpx.post(f"{url}/classify?labels=cat&labels=%FF%FE", timeout=30,
                                                files={"file": ("a.jpg", photo[0])}), 422, "invalid_request"),
        ("a label not UTF-8, form", httpx.post(f"{url}/classify", timeout=30, files=[
            ("file", ("a.jpg", photo[0])), ("labels", (None, b"cat")), ("labels", (None, b"\xff\xfe"))]), 400,
         "not_utf8"),
        ("labels in the query and the form", httpx.post(f"{url}/classify?labels=cat&labels=dog", timeout=30, files=[
            ("file", ("a.jpg", photo[0])), ("labels", (None, b"cow"))]), 400, "labels_twice"),
        ("a template without {}", classify(url, photo, ["cat", "dog"], template="a photo"), 400, "bad_template"),
        ("a template with two {}", classify(url, photo, ["cat", "dog"], template="{} and {}"), 400, "bad_template"),
        ("a template with {0}", classify(url, photo, ["cat", "dog"], template="a {} {0}"), 400, "bad_template"),
        ("a template alone", classify(url, photo, template="a photo of {}"), 400, "no_labels"),
        ("labels of a model without a text tower", classify(url, photo, ["cat", "dog"], model="shapes-vit"), 400,
         "no_text_tower"),
        ("labels and no image", httpx.post(f"{url}/classify", params={"labels": ["a", "b"]}, timeout=30), 400,
         "no_image"),
        ("labels beside a cut JPEG", classify(url, [photo[0][:300]], ["cat", "dog"]), 400, "bad_image"),
    ]
    inputs = [
        ("input as a number", embeddings(url, model="clip", input=42), 422, "invalid_request"),
        ("nested lists", embeddings(url, model="clip", input=[["a", "b"]]), 422, "invalid_request"),
        ("token ids", embeddings(url, model="clip", input=[1, 2, 3]), 422, "invalid_request"),
        ("an empty string", embeddings(url, model="clip", input=""), 400, "empty_text"),
        ("an empty string among texts", embeddings(url, model="clip", input=["a", " "]), 400, "empty_text"),
        ("an empty list", embeddings(url, model="clip", input=[]), 400, "no_inputs"),
        ("2,049 texts", embeddings(url, model="clip", input=["a"] * 2049), 413, "too_many_texts"),
        ("a 1 MB text", embeddings(url, model="clip", input="x" * 2**20), 413, "text_too_long"),
        ("a NUL", embeddings(url, model="clip", input="a\x00b"), 400, "control_character"),
        ("dimensions past the size", embeddings(url, model="clip", input="a", dimensions=17), 400, "bad_dimensions"),
        ("dimensions 0", embeddings(url, model="clip", input="a", dimensions=0), 422, "invalid_request"),
        ("an unknown field", embeddings(url, model="clip", input="a", colour="red"), 422, "invalid_request"),
        ("encoding_format float16", embeddings(url, model="clip", input="a", encoding_format="float16"), 422,
         "invalid_request"),
        ("a URL", embeddings(url, model="clip", input=["a", "https://example.com/cat.jpg"]), 400, "url_input"),
        ("a data URL of text", embeddings(url, model="clip", input=data_url(b"hello", "text/plain")), 415,
         "unsupported_media_type"),
        ("a data URL not base64", embeddings(url, model="clip", input="data:image/png,rawbytes"), 400,
         "bad_data_url"),
        ("a data URL of broken base64", embeddings(url, model="clip", input="data:image/png;base64,@@@"), 400,
         "bad_data_url"),
        ("a data URL of an image that is not", embeddings(url, model="clip", input=data_url(b"\x89PNG not")), 415,
         "unsupported_media_type"),
        ("a data URL of a cut JPEG", embeddings(url, model="clip", input=data_url(PHOTOS["coffee"][:400])), 400,
         "bad_image"),
        ("a data URL pixel bomb", embeddings(url, model="clip", input=["a", data_url(AVIF_BOMB, "image/avif")]),
         413, "image_too_large"),
        ("65 data-URL images", embeddings(url, model="clip", input=[data_url(PHOTOS["chelsea"])] * 65), 413,
         "too_many_files"),
        ("texts of a model without a text tower", embeddings(url, model="shapes-vit", input="a"), 400,
         "no_text_tower"),
        ("an unknown model", embeddings(url, model="nope", input="a"), 404, "model_not_found"),
    ]
    return label_cases + inputs


def rss(pids: list[int]) -> int:
    """The processes' resident memory together, bytes (/proc/PID/status VmRSS)."""
    total = 0
    for pid in pids:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        total += int(fields["VmRSS"].split()[0]) * 1024
    return total


def test_hostile_labels_and_inputs_are_4xx_and_the_server_keeps_serving(server):
    url, pids, _ = server
    serves(url)
    hostile_cases(url)  # once to warm every path, then its memory must come back
    before = rss(pids)
    for _ in range(3):
        for what, answer, status, code in hostile_cases(url):
            assert answer.status_code == status, (what, answer.text)
            error = answer.json()["error"]
            assert error["code"] == code and error["message"], (what, error)
        serves(url)
    assert rss(pids) - before < 64 * 2**20, "memory did not come back"


def test_the_error_names_the_limit_and_the_place(server):
    url, *_ = server
    long = embeddings(url, model="clip", input=["fine", "x" * 3000]).json()["error"]["message"]
    assert "text 1" in long and "2000" in long and "VITSERVE_MAX_TEXT_CHARS" in long
    many = classify(url, [PHOTOS["chelsea"]], [f"l{i}" for i in range(2049)], form=True).json()["error"]["message"]
    assert "2049 labels" in many and "VITSERVE_MAX_TEXTS" in many
    nul = embeddings(url, model="clip", input=["ok", "x\x00"]).json()["error"]["message"]
    assert "text 1" in nul and "U+0000" in nul
    url_input = embeddings(url, model="clip", input=["ok", "ftp://host/x.png"]).json()["error"]["message"]
    assert "input 1" in url_input and "never fetches" in url_input
    bomb = embeddings(url, model="clip", input=["ok", data_url(AVIF_BOMB, "image/avif")]).json()["error"]["message"]
    assert bomb.startswith("input 1: ")
    assert json.loads(classify(url, [PHOTOS["chelsea"]], ["cat"]).text)["error"]["code"] == "too_few_labels"
