# The serving image: FastAPI + ONNX Runtime and the model repository; no torch, no training extras.
#   docker build -t vitserve:cpu .                          plain onnxruntime
#   docker build --build-arg RUNTIME=gpu -t vitserve:gpu .  onnxruntime-gpu, CUDA 13 and cuDNN 9 from PyPI
# BASE: any Debian-like image with Python >= 3.11 and its venv module (deploy/local-base.sh makes one
# without a registry). Behind a TLS-intercepting proxy, hand pip its CA:
#   --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG RUNTIME=cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/vitserve/bin:$PATH VITSERVE_HOST=0.0.0.0
WORKDIR /app

COPY pyproject.toml README.md requirements.lock ./
COPY repository ./repository
COPY service ./service
# Every version from requirements.lock, the pins CI tests with.
RUN --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && python3 -m venv /opt/vitserve \
    && pip install --no-cache-dir --constraint requirements.lock --editable ".[${RUNTIME}]" \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin vitserve
COPY model_repository ./model_repository

USER 10001:10001
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready')"]
CMD ["python", "-m", "service"]
