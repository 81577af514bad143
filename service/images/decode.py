"""Image bytes -> the model's uint8 input, following the manifest's policy (as models.data.preprocess does).

Decoding handles what real uploads contain: EXIF orientation, grayscale, palette and alpha images
(composited on white), CMYK, 16-bit PNG/TIFF. Large JPEGs decode in draft mode, at the largest power-of-two
reduction that still covers the model's input, which is most of the decoding cost saved. The crop the model
sees is then sampled from the photo by one SIMD warp (`model_input`), close to the Pillow resample the models
were trained with (`resize_and_crop`, the reference) at a quarter of its cost. The float work (scale, mean/std,
layout) happens in the graph, on the device.

Where only the model's input is wanted (`upload_input`, the hot path), a colour or grey JPEG is decoded by
libjpeg-turbo straight into a numpy array (simplejpeg): the pixels Pillow gives, bit for bit, for three quarters
of its cost, as Pillow's image object and the copy out of it are skipped. Its size and EXIF orientation come from
`jpeg_header` where the header is plain, from Pillow otherwise.
"""
import io
from contextlib import contextmanager
from dataclasses import dataclass

import cv2
import numpy as np
import pi_heif
import simplejpeg
from PIL import Image, UnidentifiedImageError

from repository import InputPolicy
from service.core.errors import BadInput, TooLarge, UnsupportedMedia

from .avif_header import largest_frame
from .jpeg_header import jpeg_header

_SWAPS_AXES = {5, 6, 7, 8}  # EXIF orientations that turn the image by 90 degrees
# EXIF orientation -> the uint8 [h, w, 3] view that shows the photo upright, as ImageOps.exif_transpose turns it
_UPRIGHT = {
    2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2), 6: lambda a: a.transpose(1, 0, 2)[:, ::-1],
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1], 8: lambda a: a.transpose(1, 0, 2)[::-1],
}
# EXIF orientation -> Pillow's transpose that turns the photo upright (ImageOps.exif_transpose's)
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}
# the policy's filter as OpenCV samples it: bilinear for the smooth ones (its cubic warp has no SIMD path)
_WARP = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_LINEAR,
         "lanczos": cv2.INTER_LINEAR}
cv2.setNumThreads(1)  # one image a call, from many decode threads: OpenCV's own pool would oversubscribe
# HEIC/HEIF (an iPhone's photos) opened by Pillow as its own formats are: the header read first, so the pixel limit
# holds before any decoding; libheif turns the image upright (its irot/imir) and sets the EXIF orientation to 1
pi_heif.register_heif_opener()


@dataclass
class Photo:
    image: Image.Image  # upright RGB, at the resolution it was decoded at (JPEGs: possibly reduced)
    size: tuple[int, int]  # the upload's upright (width, height)
    upload: bytes | None = None  # the upload itself where `image` is reduced: what a full-size rendering decodes


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grayscale: keep the top 8 bits of 16
        pixels = np.asarray(image, dtype=np.uint32)
        image = Image.fromarray((pixels >> 8 if pixels.max() > 255 else pixels).clip(0, 255).astype(np.uint8))
    elif image.mode == "F":
        image = Image.fromarray(np.asarray(image).clip(0, 255).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")  # convert copies even to its own mode


@contextmanager
def _decoding():
    """The decoders' complaints (Pillow's, libheif's through pi-heif, libavif's) as the service's errors: a client's
    file is never a 500."""
    try:
        yield
    except Image.DecompressionBombError as e:
        raise TooLarge(str(e), "image_too_large") from None
    except UnidentifiedImageError:
        raise UnsupportedMedia("not an image this server can decode (JPEG, PNG, WebP, HEIC, AVIF, GIF, BMP, "
                               "TIFF)") from None
    except RuntimeError as e:  # pi-heif's: libheif's errors, its security limits among them
        if "Security limit exceeded" in str(e):  # past libheif's bounds, or larger than the file says it is
            raise TooLarge(f"the image is larger than it may be decoded: {e}".strip(), "image_too_large") from None
        raise BadInput(f"the image could not be decoded: {e}".strip(), "bad_image") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise BadInput(f"the image could not be decoded: {e}", "bad_image") from None


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """The image, its header read and nothing decoded yet; a non-image or one over max_pixels raises. An AVIF's
    pixels are counted in the frames its AV1 data decodes, which its declared size need not bound (avif_header.py);
    libheif itself refuses a HEIC that decodes larger than its declared size (seen with libheif 1.23: a 8192 x 8192
    HEIC declaring 64 x 64 is refused before its planes are allocated)."""
    with _decoding():
        image = Image.open(io.BytesIO(data))
        _check_pixels(*image.size, max_pixels)
        if image.format == "AVIF":
            width, height = largest_frame(data)
            if width * height > max_pixels:
                raise TooLarge(f"image declares {image.width}x{image.height} but decodes frames of {width}x{height} "
                               f"= {width * height} pixels; the limit is {max_pixels}", "image_too_large")
    return image


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise TooLarge(f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                       "image_too_large")


def _plain_jpeg(data: bytes, max_pixels: int) -> tuple[int, int, int | None] | None:
    """`jpeg_header`'s (width, height, EXIF orientation), over max_pixels raising; None where Pillow reads the
    header."""
    if (header := jpeg_header(data)) is not None:
        _check_pixels(*header[:2], max_pixels)
    return header


def decode_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """The image's (width, height) from its header alone, with the errors `decode` would raise for a non-image
    or a bomb."""
    header = _plain_jpeg(data, max_pixels)
    return header[:2] if header is not None else _open(data, max_pixels).size


def decode(data: bytes, min_short_side: int | None, max_pixels: int) -> Photo:
    """Bytes -> upright RGB photo. With `min_short_side`, a JPEG may decode reduced (draft mode) as long as
    its short side stays >= min_short_side; without, at full size."""
    return _photo(_open(data, max_pixels), data, min_short_side)


def _photo(image: Image.Image, data: bytes, min_short_side: int | None) -> Photo:
    """`decode` of an opened image (its header read, nothing decoded yet)."""
    width, height = image.size
    with _decoding():
        if image.format == "JPEG" and min_short_side:
            image.draft("RGB", (min_short_side, min_short_side))
        image.load()  # decodes, here: a damaged image is a BadInput, not an error wherever its pixels are read
        orientation = image.getexif().get(0x0112)
        size = (height, width) if orientation in _SWAPS_AXES else (width, height)
        if orientation in _TRANSPOSE:  # ImageOps.exif_transpose's turn, without writing the EXIF back (which
            image = image.transpose(_TRANSPOSE[orientation])  # raised TypeError on some damaged ones: a 500)
        return Photo(_to_rgb(image), size, data if image.size != size else None)


def upload_input(data: bytes, policy: InputPolicy, max_pixels: int) -> np.ndarray:
    """Image bytes -> the model's `images` input for it (`model_input` of the decoded photo). A colour or grey JPEG
    is decoded by simplejpeg, reduced as `decode`'s draft mode would and turned upright by its EXIF orientation;
    anything else, and any JPEG libjpeg-turbo reads only with warnings, goes through `decode` (Pillow, its
    leniency and its errors). The header is read by `jpeg_header` where it is plain, else by Pillow."""
    header = _plain_jpeg(data, max_pixels)
    if header is None:
        image = _open(data, max_pixels)
        if image.format != "JPEG" or image.mode not in ("RGB", "L"):
            return model_input(_photo(image, data, policy.draft_side).image, policy)
        with _decoding():
            header = (*image.size, image.getexif().get(0x0112))
    width, height, orientation = header
    scale = _draft_scale(width, height, policy.draft_side)
    try:  # the smallest libjpeg-turbo scaling that covers these sizes is 1 / scale
        pixels = simplejpeg.decode_jpeg(data, "RGB", min_height=-(-height // scale), min_width=-(-width // scale))
    except ValueError:  # rare: Pillow decides, its header read once more
        return model_input(decode(data, policy.draft_side, max_pixels).image, policy)
    upright = _UPRIGHT.get(orientation)
    return model_input(np.ascontiguousarray(upright(pixels)) if upright else pixels, policy)


def _draft_scale(width: int, height: int, side: int | None) -> int:
    """The reduction Pillow's JPEG draft mode picks for a requested size of side x side: the largest of 1, 2, 4 and
    8 that its whole-number ratio allows (JpegImagePlugin.draft); 1 without a side."""
    if side is None:
        return 1
    ratio = min(width // side, height // side)  # 0 for a photo smaller than the side: no reduction
    return next((scale for scale in (8, 4, 2) if ratio >= scale), 1)


def resize_and_crop(image: Image.Image, policy: InputPolicy) -> Image.Image:
    """Short side to policy.resize_short_side (aspect kept), then the centre crop of the input size, with Pillow's
    filter of the policy: the reference the models were trained with (models.data.preprocess). The crop's region
    of the image resized alone, with the same filter positions as the whole (a third less work on a landscape
    photo; within one level of resize-then-crop, where float rounding of the region's edges differs)."""
    width, height = image.size
    (rw, rh), (left, top, right, bottom) = policy.resized(width, height), policy.crop(width, height)
    sx, sy = width / rw, height / rh
    return image.resize((right - left, bottom - top), Image.Resampling[policy.interpolation.upper()],
                        box=(left * sx, top * sy, right * sx, bottom * sy))


def model_input(image: Image.Image | np.ndarray, policy: InputPolicy) -> np.ndarray:
    """The model's `images` input for one upright RGB photo (a Pillow image or uint8 [h, w, 3]): uint8 [H, W, 3],
    the crop of `resize_and_crop` sampled straight from the photo by one affine warp (OpenCV's SIMD bilinear:
    0.1 ms for 224 x 224 where Pillow's bicubic resample took 0.7, and within a level or two of it:
    docs/models.md). Where the photo shrinks 2x or more it is first box-reduced by the whole factor, so that every
    pixel still counts (sampling alone would alias)."""
    pillow = isinstance(image, Image.Image)
    if policy.processor_resize:  # transformers' own steps: the whole photo resized with Pillow, then the crop
        image = image if pillow else Image.fromarray(image)
        width, height = image.size
        resized = image.resize(policy.resized(width, height), Image.Resampling[policy.interpolation.upper()])
        return np.asarray(resized.crop(policy.crop(width, height)))
    if policy.resize_to is not None:  # a Hugging Face model's: its image processor's own Pillow resize, not near it
        return np.asarray(resize_and_crop(image if pillow else Image.fromarray(image), policy))
    width, height = image.size if pillow else (image.shape[1], image.shape[0])
    (rw, rh), (left, top, _, _) = policy.resized(width, height), policy.crop(width, height)
    if (k := int(min(width / rw, height / rh))) >= 2:
        image = (image if pillow else Image.fromarray(image)).reduce(k)
    pixels = np.asarray(image)
    sx, sy = pixels.shape[1] / rw, pixels.shape[0] / rh
    out_h, out_w = policy.size
    # output pixel centre j + 0.5 lies at (left + j + 0.5) * sx in the photo's pixel-centre coordinates
    x, y = (left + 0.5) * sx - 0.5, (top + 0.5) * sy - 0.5
    # the warp is given the window it samples, two pixels wider each way than its bilinear taps (OpenCV refuses
    # a source of 32,767 pixels or more a side, which a panorama within the pixel limit can be)
    x0, y0 = max(int(x) - 2, 0), max(int(y) - 2, 0)
    x1, y1 = int(x + out_w * sx) + 3, int(y + out_h * sy) + 3
    to_window = np.array([[sx, 0, x - x0], [0, sy, y - y0]])
    return cv2.warpAffine(pixels[y0:y1, x0:x1], to_window, (out_w, out_h),
                          flags=_WARP[policy.interpolation] | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REPLICATE)
