"""Peer "fastapi": the service a developer writes first. FastAPI and one ONNX Runtime session, no batching: a sync
endpoint (FastAPI runs it in its thread pool) reads the multipart upload, preprocesses it and runs the graph on it
alone; uvicorn, one process, no access log.

    python bench/peers/fastapi_server.py PORT   # fastapi, uvicorn[standard], python-multipart, onnxruntime
"""
import sys

import uvicorn
from fastapi import FastAPI, UploadFile

import common

app = FastAPI()
session = common.session()


@app.post("/classify")
def classify(file: UploadFile) -> dict:
    images = common.preprocess(file.file.read())[None]
    return common.top1(common.run(session, images)[0][0])


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
