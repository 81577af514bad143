"""Image bytes to the model's input: decoding (Pillow, libjpeg-turbo, pi-heif), the headers read before it (JPEG, AVIF),
and GPU decoding with nvImageCodec.

Imports core alone.
"""
