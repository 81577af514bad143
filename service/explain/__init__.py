"""Attention maps: rendering them over the photo, and the attention results kept for GET /attention-map.

Imports core alone.
"""
