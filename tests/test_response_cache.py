"""The response cache (VITSERVE_RESPONSE_CACHE_BYTES, service/pipeline/response_cache.py): its bound and order, its
keys, and a real service on both backends answering a repeated image from it, counted as Triton counts, missing on any
change of the upload, the question or the model."""
import shutil

import httpx
import numpy as np
import pytest
from service_process import ROOT, direct_probabilities, metric, photo_bytes, running_service, write_model

from service.pipeline.response_cache import ENTRY_BYTES, ResponseCache, upload_key

REPO = ROOT / "model_repository"
JPEG, PNG = photo_bytes("chelsea", "JPEG"), photo_bytes("coffee", "PNG")


def test_the_least_recently_used_answers_go_first_and_the_bytes_stay_within_the_bound():
    row = {"probs": np.zeros(10, np.float32), "top_index": np.zeros(10, np.int32)}  # 80 bytes
    cache = ResponseCache(3 * (ENTRY_BYTES + 80))
    keys = [upload_key("shapes-vit", 1, 5, bytes([i])) for i in range(4)]
    for key in keys[:3]:
        cache.put(key, row)
    assert cache.get(keys[0]) is row  # used: keys[1] is now the least recently used
    cache.put(keys[3], row)
    assert cache.get(keys[1]) is None and all(cache.get(k) is row for k in (keys[0], keys[2], keys[3]))
    assert cache.nbytes == 3 * (ENTRY_BYTES + 80) == cache.max_bytes
    cache.put(upload_key("shapes-deit", 1, 5, b"x"), row)
    cache.forget("shapes-vit")
    assert len(cache) == 1 and cache.nbytes == ENTRY_BYTES + 80
    cache.put(keys[0], {"probs": np.zeros(1000, np.float32)})  # larger than the whole: not kept
    assert cache.get(keys[0]) is None


def test_the_key_is_the_whole_upload_the_model_version_and_the_question():
    key = upload_key("shapes-vit", 1, 5, JPEG)
    assert key == upload_key("shapes-vit", 1, 5, bytes(JPEG))
    # uploads alike but in their last byte, or the one a prefix of the other: never taken for one another
    assert key != upload_key("shapes-vit", 1, 5, JPEG[:-1] + bytes([JPEG[-1] ^ 1]))
    assert key != upload_key("shapes-vit", 1, 5, JPEG + b"\0")
    assert len({key, upload_key("shapes-deit", 1, 5, JPEG), upload_key("shapes-vit", 2, 5, JPEG),
                upload_key("shapes-vit", 1, 4, JPEG)}) == 4  # another model, a reload, another top_k


def classify(url: str, *uploads: bytes, top_k: int = 3) -> list[dict]:
    response = httpx.post(f"{url}/classify", params={"model": "shapes-vit", "top_k": top_k},
                          files=[("files", (f"{i}.img", data)) for i, data in enumerate(uploads)], timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["results"]


def answers(url: str, uploads: list[bytes]) -> tuple[int, list]:
    """A request's status, and each file's answer (its labels and scores, or its error's code) or the request's error
    code."""
    r = httpx.post(f"{url}/classify", params={"model": "shapes-vit"}, timeout=60,
                   files=[("files", (f"{i}.img", data)) for i, data in enumerate(uploads)])
    if r.status_code != 200:
        return r.status_code, [r.json()["error"]["code"]]
    return 200, [result.get("predictions") or result["error"]["code"] for result in r.json()["results"]]


def counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    stats = httpx.get(f"{url}/v2/models/shapes-vit/stats", timeout=30).json()["model_stats"][0]["inference_stats"]
    return {"decoded": metric(text, "vitserve_decode_seconds_count"),
            "run": metric(text, "vitserve_images_total", model="shapes-vit"),
            "hits": stats["cache_hit"]["count"], "misses": stats["cache_miss"]["count"],
            "triton hits": metric(text, "nv_cache_num_hits_per_model", model="shapes-vit", version="1")}


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_repeated_image_is_answered_without_a_decode_or_a_batch_until_anything_that_changes_it_changes(
        backend, tmp_path):
    shutil.copytree(REPO / "shapes-vit", tmp_path / "shapes-vit")
    settings = {"workers": 1} if backend == "process" else {}  # one worker: one cache, whichever connection
    with running_service(model_repository=tmp_path, model_control="explicit", backend=backend,
                         response_cache_bytes=1_000_000, **settings) as url:
        [first] = classify(url, JPEG)
        before = counts(url)
        [again] = classify(url, JPEG)
        after = counts(url)
        assert again["predictions"] == first["predictions"] and first["batch_size"] >= 1 and again["batch_size"] == 0
        assert after["decoded"] == before["decoded"] and after["run"] == before["run"]  # no decode, no batch
        assert (after["hits"], after["misses"], after["triton hits"]) == (1, 1, 1)
        # an album: the photo twice more beside a new one; a byte past the JPEG's end (the same pixels); another k
        album = classify(url, JPEG, PNG, JPEG)
        assert [r["batch_size"] == 0 for r in album] == [True, False, True]
        assert album[0]["predictions"] == album[2]["predictions"] == first["predictions"]
        [padded] = classify(url, JPEG + b"\0")
        [other_k] = classify(url, JPEG, top_k=2)
        assert padded["batch_size"] >= 1 and padded["predictions"] == first["predictions"]
        assert other_k["batch_size"] >= 1 and other_k["predictions"] == first["predictions"][:2]
        assert (counts(url)["hits"], counts(url)["misses"]) == (3, 4)
        # files that cannot be read beside photos: each request answered first with none of it cached (as with the
        # cache off) and again with its photos cached, the same status and the same answers either way
        # (each album's photos new to the cache: its first answer is a cold one)
        cut = JPEG[:len(JPEG) // 3]
        coffee, astronaut, rocket = (photo_bytes(name, "JPEG") for name in ("coffee", "astronaut", "rocket"))
        for album in ([coffee, cut], [astronaut, astronaut, b""], [rocket, cut, b""], [cut, b""]):
            hits = counts(url)["hits"]
            uncached = answers(url, album)
            assert counts(url)["hits"] == hits, album  # none of it answered from the cache
            cached = answers(url, album)
            assert cached == uncached, (cached, uncached)
        assert answers(url, [coffee, cut])[0] == 200 and answers(url, [cut, b""])[0] in (400, 415)
        # the model reloads with other weights (its int8 graph): the answer is the new one's, never the cached
        write_model(tmp_path / "shapes-vit", REPO / "shapes-vit-int8", "shapes-vit")
        assert httpx.post(f"{url}/v2/repository/models/shapes-vit/load", timeout=120).status_code == 200
        [reloaded] = classify(url, JPEG)
        want = np.sort(direct_probabilities(REPO / "shapes-vit-int8", JPEG))[::-1][:3]
        assert reloaded["batch_size"] >= 1 and np.abs(want - [p["score"] for p in first["predictions"]]).max() > 1e-4
        np.testing.assert_allclose([p["score"] for p in reloaded["predictions"]], want, atol=1e-5)
