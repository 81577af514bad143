"""The trainer, for a few steps on a tiny synthetic dataset (the real demo runs are in models/demo)."""
import json

import numpy as np
import pytest
import torch
from face_scenes import astronaut_face
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from service_process import ROOT

import models
from models.mini_xception import PRETRAINED
from models.synthetic import __main__ as synthetic
from models.train import load_teacher, main

CNN = ROOT / "model_repository" / "expression-fer2013"


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    synthetic.main(["shapes", "--out", str(root), "--train", "24", "--val", "12", "--workers", "1"])
    return root


@pytest.fixture(scope="module")
def faces_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("faces")
    synthetic.main(["faces", "--out", str(root), "--train", "14", "--val", "7", "--workers", "1"])
    return root


def run(data, out, *extra):
    main(["vit_micro_patch8_96", "--data", str(data), "--out", str(out), "--batch-size", "8", "--workers", "0",
          *extra])


def test_training_writes_loadable_weights_labels_and_summary(shapes_dir, tmp_path):
    run(shapes_dir, tmp_path, "--epochs", "1", "--max-steps", "2")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["model"] == "vit_micro_patch8_96" and json.loads(meta["labels"])[0] == "circle"
    assert (tmp_path / "labels.txt").read_text().split() == ["circle", "square", "triangle", "star", "cross", "heart"]
    models.load_weights(models.create_model("vit_micro_patch8_96"), tmp_path / "model.safetensors")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["command"].startswith("python -m models.train vit_micro_patch8_96 --data")
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and summary["val_images"] == 12


def test_resume_continues_to_the_same_weights(shapes_dir, tmp_path):
    run(shapes_dir, tmp_path / "straight", "--epochs", "2")
    run(shapes_dir, tmp_path / "resumed", "--epochs", "1")
    run(shapes_dir, tmp_path / "resumed", "--epochs", "2", "--resume")
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    history = json.loads((tmp_path / "resumed" / "summary.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2]


def test_hard_distillation_from_a_teacher(shapes_dir, tmp_path):
    run(shapes_dir, tmp_path / "teacher", "--epochs", "1", "--max-steps", "1")
    main(["deit_micro_distilled_patch8_96", "--data", str(shapes_dir), "--out", str(tmp_path / "student"),
          "--teacher", str(tmp_path / "teacher" / "model.safetensors"), "--batch-size", "8", "--workers", "0",
          "--epochs", "1", "--max-steps", "2"])
    assert (tmp_path / "student" / "model.safetensors").is_file()
    with pytest.raises(SystemExit, match="needs a distilled student"):
        run(shapes_dir, tmp_path / "not-distilled", "--teacher", str(tmp_path / "teacher" / "model.safetensors"))


@pytest.mark.parametrize("teacher", [CNN, PRETRAINED], ids=["exported", "weights"])
def test_the_expression_cnn_teaches_a_deit_student(faces_dir, tmp_path, teacher):
    main(["deit_micro_distilled_patch16_fer_112", "--data", str(faces_dir), "--out", str(tmp_path), "--teacher",
          str(teacher), "--batch-size", "8", "--workers", "0", "--epochs", "1", "--max-steps", "1"])
    assert (tmp_path / "model.safetensors").is_file()


def test_the_expression_cnn_fine_tunes_from_its_weights(faces_dir, tmp_path):
    main(["mini_xception_fer2013_64", "--data", str(faces_dir), "--out", str(tmp_path),
          "--weights", str(PRETRAINED), "--batch-size", "8", "--workers", "0", "--epochs", "1", "--max-steps", "1"])
    models.load_weights(models.create_model("mini_xception_fer2013_64"), tmp_path / "model.safetensors")


def test_the_cnn_teachers_labels_come_in_the_students_order_whether_exported_or_weights(shapes_dir):
    """Her smiling face, at the student's 112 pixels: happiness, named in a student order unlike the teacher's."""
    order = ["neutral", "sadness", "happiness", "surprise", "anger", "disgust", "fear"]
    face = np.asarray(astronaut_face().resize((112, 112), Image.BICUBIC), np.float32) / 255
    x = torch.from_numpy(face).permute(2, 0, 1)[None].repeat(2, 1, 1, 1)
    exported, weights = (load_teacher(t, None, order)(x) for t in (CNN, PRETRAINED))
    assert torch.equal(exported, weights) and [order[i] for i in exported] == ["happiness"] * 2
    with pytest.raises(SystemExit, match="the teacher .* knows anger, disgust"):
        main(["deit_micro_distilled_patch8_96", "--data", str(shapes_dir), "--teacher", str(CNN)])


def test_bad_data_fails_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="no data folder"):
        run(tmp_path / "absent", tmp_path / "out")
    (tmp_path / "one" / "cats").mkdir(parents=True)
    with pytest.raises(SystemExit, match="at least two"):
        run(tmp_path / "one", tmp_path / "out")
    with pytest.raises(SystemExit, match="unknown model"):
        main(["vit_huge", "--data", str(tmp_path / "one")])
    assert not (tmp_path / "out").exists()
