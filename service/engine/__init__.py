"""Where batches run: ONNX Runtime sessions (runtime), dynamic batching, the per-image records and what a task's head
makes of a batch, shared memory, and the backends (in this process, or an inference process behind HTTP workers).

Imports core, images and explain; never the pipeline, the protocol or the web stack.
"""
