# The serving image: FastAPI + ONNX Runtime and the model repository. No torch, no training extras.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 VITSERVE_HOST=0.0.0.0
WORKDIR /app

COPY pyproject.toml README.md ./
COPY repository ./repository
COPY service ./service
RUN pip install --no-cache-dir --editable . && useradd --create-home vitserve
COPY model_repository ./model_repository

USER vitserve
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready')"]
CMD ["python", "-m", "service"]
