"""Label sets the registry and the synthetic data share."""

# RAF-DB's basic-expression order (labels 1..7 in its annotation files).
RAF_DB_LABELS = ("surprise", "fear", "disgust", "happiness", "sadness", "anger", "neutral")
SHAPE_LABELS = ("circle", "square", "triangle", "star", "cross", "heart")
