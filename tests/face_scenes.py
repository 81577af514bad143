"""Scenes with known faces, made from real photographs: scikit-image's astronaut and the faces and non-faces of
its lfw_subset (100 of each, 25 x 25 grey crops). Shared by the tests and bench/face_detection.py.

Faces are (centre x, centre y, side) in the scene's pixels; a detector's box [x0, y0, x1, y1] finds one when its
centre lies within a quarter side of the face's centre and its size is within a factor of two of the side.
"""
import numpy as np
from PIL import Image
from skimage import data as photos

# Eileen Collins's face in skimage's astronaut (512 x 512), [x, y, w, h]: OpenCV's Haar cascade's box, checked
# by eye once (brow to chin, ear to ear).
ASTRONAUT_FACE = (182, 70, 90, 92)
SIDES = (180, 140, 110, 90, 70)  # the pasted faces' sides, in pixels


def lfw_scenes(side: int = 100, canvas: int = 200) -> tuple[list[Image.Image], list[Image.Image], tuple]:
    """Each lfw_subset crop upscaled to `side` in the middle of a grey canvas: (the 100 faces' scenes, the 100
    non-faces' scenes, the face's (cx, cy, side) in every face scene)."""
    crops = (photos.lfw_subset() * 255).round().astype(np.uint8)
    scenes = []
    for crop in crops:
        scene = Image.new("RGB", (canvas, canvas), (128, 128, 128))
        scene.paste(Image.fromarray(crop).resize((side, side), Image.BICUBIC).convert("RGB"),
                    ((canvas - side) // 2, (canvas - side) // 2))
        scenes.append(scene)
    return scenes[:100], scenes[100:], (canvas / 2, canvas / 2, side)


def astronaut_face() -> Image.Image:
    """Her face with a 10-pixel margin, as pasted into the scenes."""
    x, y, w, h = ASTRONAUT_FACE
    return Image.fromarray(photos.astronaut()).crop((x - 10, y - 10, x + w + 10, y + h + 10))


def paste(scene: Image.Image, source: Image.Image, cx: int, cy: int, side: int, angle: int) -> tuple:
    """`source` resized to `side`, turned `angle` degrees in-plane and pasted centred on (cx, cy): the face."""
    face = source.resize((side, side), Image.BICUBIC).convert("RGBA").rotate(angle, Image.BICUBIC, expand=True)
    scene.paste(face, (round(cx - face.width / 2), round(cy - face.height / 2)), face)
    return cx, cy, side, angle


def group_photo(angles: tuple[int, ...] = (-30, -15, 0, 15, 30)) -> tuple[Image.Image, list[tuple]]:
    """A scene 1400 pixels wide over a real texture: the astronaut's face and four lfw faces, at sides from 180
    down to 70 pixels, in one 250-pixel row per angle of `angles` (degrees, in-plane). (The scene, its faces as
    (cx, cy, side, angle).)"""
    scene = Image.fromarray(photos.gravel()).convert("RGB").resize((1400, 250 * len(angles)))
    sources = [astronaut_face()]
    sources += [Image.fromarray((photos.lfw_subset()[k] * 255).astype(np.uint8)).convert("RGB") for k in (0, 2, 3, 5)]
    faces = [paste(scene, source, 140 + col * 280, 125 + row * 250, side, angle) for row, angle in enumerate(angles)
             for col, (source, side) in enumerate(zip(sources, SIDES))]
    return scene, faces


def astronaut_five_times() -> tuple[Image.Image, list[tuple]]:
    """The astronaut's face five times over a real texture, at sides from 180 down to 70 pixels, turned from -30 to
    30 degrees. (The scene, its faces as (cx, cy, side, angle).)"""
    scene = Image.fromarray(photos.gravel()).convert("RGB").resize((1400, 260))
    faces = [paste(scene, astronaut_face(), 140 + i * 280, 130, side, angle)
             for i, (side, angle) in enumerate(zip(SIDES, (-30, -15, 0, 15, 30)))]
    return scene, faces


def found(boxes: np.ndarray, face: tuple) -> bool:
    """Whether one of the boxes [n, 4] (x0, y0, x1, y1) is this face (cx, cy, side, ...)."""
    cx, cy, side = face[:3]
    centres, sizes = (boxes[:, :2] + boxes[:, 2:4]) / 2, np.sqrt(np.prod(boxes[:, 2:4] - boxes[:, :2], axis=1))
    near = np.hypot(centres[:, 0] - cx, centres[:, 1] - cy) <= side / 4
    return bool(np.any(near & (sizes >= side / 2) & (sizes <= side * 2)))
