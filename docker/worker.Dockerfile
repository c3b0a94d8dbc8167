# The model worker: Qwen3 on one NVIDIA GPU. Also runs the demo checkpoint writer, which
# needs torch too. Build from the repository root: docker build -f docker/worker.Dockerfile .
#
# The CUDA build of torch from PyPI brings its own CUDA runtime, cuDNN and NCCL as
# nvidia-* wheels, so a slim Python base is enough: the host supplies only the driver,
# through the NVIDIA Container Toolkit. A CUDA base image would ship those libraries twice.
FROM python:3.11-slim

# PyPI's torch wheels for Linux x86_64 are the CUDA build. To pick another CUDA version,
# build with e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130.
ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/hf-cache

WORKDIR /app

# torch first, from its own index and at the version requirements.txt pins; then the rest
# from PyPI, with torch filtered out so pip cannot swap in a different build.
COPY requirements.txt .
RUN pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' requirements.txt)" \
 && grep -v '^torch' requirements.txt > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# A new named volume copies the ownership of the directory it is mounted on, so these
# mount points decide that the non-root user can write the weights and the HF cache.
RUN useradd --create-home --uid 1000 app \
 && mkdir -p /models /hf-cache \
 && chown app:app /models /hf-cache

COPY vllm_v0/ vllm_v0/
COPY rpcserver/ rpcserver/
COPY services/__init__.py services/__init__.py
COPY services/model_worker/ services/model_worker/
COPY demo/ demo/

USER app
EXPOSE 50053
CMD ["python", "-m", "services.model_worker", "--host", "0.0.0.0", "--port", "50053", \
     "--model", "/models/demo", "--device", "cuda", "--dtype", "auto"]
