"""The routes, one module per resource: each parses its request, hands it to a pipeline, and encodes the answer."""
