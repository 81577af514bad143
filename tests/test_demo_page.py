"""The demo page at / in a real browser (headless Debian Chromium, driven by Playwright) against a real server: a
photograph's predictions and attention overlay, a held-out shape's nearest sample shapes, a face box where the
astronaut's face is, and a readable error for a non-image. Skips with the reason where Chromium or Playwright is missing
(.ci/run installs Chromium; the `test` extra, Playwright). Saves build/demo-page.png, the README's picture."""
import io
import shutil

import httpx
import pytest
from face_scenes import ASTRONAUT_FACE
from service_process import ROOT, photo_bytes, running_service

from models.labels import SHAPE_LABELS
from models.synthetic import sample_rng
from models.synthetic.shapes import shapes, two_shapes

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the `test` extra)")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (.ci/run: apt-get install chromium)")
# the flags a root, offline machine needs: no sandbox, no GPU, no calls home
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="module")
def url():
    with running_service() as base:
        yield base


@pytest.fixture(scope="module")
def page(url):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 390, "height": 844})  # a phone's screen
        page.goto(f"{url}/")
        page.wait_for_function("document.getElementById('model').options.length > 0")
        yield page
        browser.close()


def upload(page, tmp_path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    page.set_input_files("#file", str(path))


def test_a_photo_gets_its_top_five_and_the_attention_overlay(url, page, tmp_path):
    jpeg = photo_bytes("chelsea", "JPEG")
    page.select_option("#model", "shapes-deit")
    upload(page, tmp_path, "chelsea.jpg", jpeg)
    page.wait_for_function("document.querySelectorAll('#predictions li').length === 5")
    page.wait_for_function("document.getElementById('photo').dataset.kind === 'attention-map'"
                           " && document.getElementById('photo').naturalWidth > 0")
    # the overlay at the photo's own size, though the model's decode of the JPEG was reduced
    assert page.evaluate("[document.getElementById('photo').naturalWidth, "
                         "document.getElementById('photo').naturalHeight]") == [451, 300]
    api = httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", jpeg)}, params={"model": "shapes-deit"})
    assert page.locator("#predictions .label").first.inner_text() == api.json()["results"][0]["predictions"][0]["label"]
    assert page.is_visible("#token")  # distilled DeiT: its two tokens can be chosen
    top = api.json()["results"][0]["predictions"][0]["label"]  # and why it gives its top label, beside the map
    page.wait_for_function(f"document.getElementById('relevance').dataset.label === {top!r}"
                           " && document.getElementById('relevance').naturalWidth > 0")
    (ROOT / "build").mkdir(exist_ok=True)
    page.screenshot(path=str(ROOT / "build" / "demo-page.png"), full_page=True)


def test_a_label_of_the_top_five_shows_why_beside_the_attention_map(url, page, tmp_path):
    """The top label's relevance map shows beside the attention map; a click on another label of the five shows
    that label's map, the one GET /attention-map?method=relevance&label= gives."""
    image, labels, _ = two_shapes(sample_rng(31337, 1))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    page.select_option("#model", "shapes-vit")
    upload(page, tmp_path, "two.png", buffer.getvalue())
    # this upload's run done (its neighbours come last): the model's selection ran the previous photo first, whose
    # predictions may show until then
    page.wait_for_function("document.getElementById('nearest').dataset.photo === 'two.png'")
    page.wait_for_function("document.querySelectorAll('#predictions li.explainable').length === 5")
    top = page.locator("#predictions .label").first.inner_text()
    page.wait_for_function(f"document.getElementById('relevance').dataset.label === {top!r}"
                           " && document.getElementById('relevance').naturalWidth > 0")
    assert page.is_visible("#photo") and page.is_visible("#relevance")
    other = page.locator("#predictions li").nth(1)
    label = other.get_attribute("data-label")
    other.click()
    page.wait_for_function(f"document.getElementById('relevance').dataset.label === {label!r}")
    assert "explained" in other.get_attribute("class") and label in page.inner_text("#whylabel")


def test_a_clips_labels_typed_in_the_page_score_the_photo(url, page, tmp_path):
    """A whole CLIP selected (the embedded shapes-clip): the labels field shows (hidden for the others), and the
    labels typed there score the photo as POST /classify?labels= does, best first, beside its nearest sample shapes."""
    sample = shapes(seed=1, count=4)[3]  # a held-out star
    buffer = io.BytesIO()
    sample.image.save(buffer, format="PNG")
    page.select_option("#model", "shapes-vit")
    assert not page.is_visible("#labels") and not page.is_visible("#search")
    page.select_option("#model", "shapes-clip")
    assert page.is_visible("#labels")
    page.fill("#labels", "star, heart ,  circle,")
    upload(page, tmp_path, "star.png", buffer.getvalue())
    page.wait_for_function("document.querySelectorAll('#predictions li').length === 3")
    page.wait_for_function("document.getElementById('nearest').dataset.photo === 'star.png'")
    api = httpx.post(f"{url}/classify", files={"file": ("star.png", buffer.getvalue())}, timeout=30,
                     params={"model": "shapes-clip", "labels": ["star", "heart", "circle"]})
    want = api.json()["results"][0]["predictions"]
    assert want[0]["label"] == "star"
    assert page.locator("#predictions .label").all_inner_texts() == [p["label"] for p in want]
    assert page.locator("#predictions .score").all_inner_texts() == [f"{100 * p['score']:.1f}%" for p in want]
    page.fill("#labels", "")


@pytest.mark.parametrize("label", ["star", "heart"])
def test_a_clips_text_search_finds_the_sample_shapes_it_names(page, label):
    """The text box of a whole CLIP: the text's /v1/embeddings vector against the sample shapes' /embed vectors,
    the nearest first, without a photo."""
    page.select_option("#model", "shapes-clip")
    page.fill("#search", f"a photo of a {label}.")
    page.dispatch_event("#search", "change")
    page.wait_for_function(f"document.getElementById('found').dataset.text === 'a photo of a {label}.'")
    found = page.locator("#found li")
    assert found.count() == 3 and found.first.get_attribute("data-shape") == label
    cosines = [float(found.nth(i).inner_text().split()[-1]) for i in range(3)]
    assert cosines == sorted(cosines, reverse=True)


@pytest.mark.parametrize("label", [3, 5])  # a star, a heart
def test_a_held_out_shapes_nearest_sample_shapes_are_found_with_embed_alone(url, page, tmp_path, label):
    """The page draws its own sample shapes, embeds them with the dropped image in one /embed request and ranks
    them by cosine: a held-out demo image's nearest is of its own shape."""
    sample = shapes(seed=1, count=label + 1)[label]
    buffer = io.BytesIO()
    sample.image.save(buffer, format="PNG")
    page.select_option("#model", "shapes-vit")
    upload(page, tmp_path, f"shape-{label}.png", buffer.getvalue())
    page.wait_for_function(f"document.getElementById('nearest').dataset.photo === 'shape-{label}.png'")
    assert page.locator("#nearest li").count() == 3
    nearest = page.locator("#nearest li")
    cosines = [float(nearest.nth(i).inner_text().split()[-1]) for i in range(3)]
    assert cosines == sorted(cosines, reverse=True) and -1 <= cosines[-1] <= cosines[0] <= 1
    assert nearest.first.get_attribute("data-shape") == SHAPE_LABELS[label]


def test_the_astronaut_gets_one_face_box_where_her_face_is_with_its_landmarks(page, tmp_path):
    assert "default for faces" in page.locator('#model option[value="expression-fer2013"]').inner_text()
    page.select_option("#model", "expression-fer2013")
    upload(page, tmp_path, "astronaut.jpg", photo_bytes("astronaut", "JPEG"))
    page.wait_for_selector(".face")
    assert page.locator(".face").count() == 1
    x, y, w, h = (int(v) for v in page.locator(".face").get_attribute("data-box").split(","))
    fx, fy, fw, fh = ASTRONAUT_FACE
    overlap = max(0, min(x + w, fx + fw) - max(x, fx)) * max(0, min(y + h, fy + fh) - max(y, fy))
    assert overlap / (w * h + fw * fh - overlap) >= 0.5
    drawn = page.locator(".face").bounding_box()
    assert drawn["width"] > 20  # drawn over the picture, not just in the DOM
    assert page.locator(".face span").inner_text().startswith("happiness")  # she smiles
    assert page.locator(".landmark").count() == 5
    for i in range(5):
        dot = page.locator(".landmark").nth(i).bounding_box()
        cx, cy = dot["x"] + dot["width"] / 2, dot["y"] + dot["height"] / 2
        assert drawn["x"] < cx < drawn["x"] + drawn["width"] and drawn["y"] < cy < drawn["y"] + drawn["height"]


def test_a_non_image_shows_the_servers_message(page, tmp_path):
    upload(page, tmp_path, "notes.txt", b"just some text")
    page.wait_for_selector("#error", state="visible")
    assert "not an image" in page.inner_text("#error")
