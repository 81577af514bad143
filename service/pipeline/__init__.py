"""One pipeline per model: a request's images decoded into records, batched and run on a backend, their results read
back; faces found for /expression; the response cache.

Imports core, images, explain and engine.
"""
