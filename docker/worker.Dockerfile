# The model worker: Qwen3 on one NVIDIA GPU. Also runs the demo checkpoint writer, which
# needs torch too. Build from the repository root: docker build -f docker/worker.Dockerfile .
#
# A CUDA build of torch brings its own CUDA runtime, cuDNN and NCCL as
# nvidia-* wheels, so a slim Python base is enough: the host supplies only the driver,
# through the NVIDIA Container Toolkit. A CUDA base image would ship those libraries twice.
FROM python:3.11-slim

# The torch build decides which NVIDIA drivers the image runs on (README, "Docker Compose"):
#   https://download.pytorch.org/whl/cu126 (default)  CUDA 12.6: drivers >= 560, and 13.x drivers too
#   https://download.pytorch.org/whl/cu130            CUDA 13.0: drivers >= 580 only
# PyPI's own torch 2.13.0 for Linux x86_64 is the CUDA 13 build (its nvidia-*-cu13 dependencies
# say so): on a 12.x driver it sees no GPU. Pick with --build-arg TORCH_INDEX_URL=...
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/hf-cache

WORKDIR /app

# A C compiler at run time: Triton compiles a small launcher for each GPU kernel on first use,
# and the worker builds its CPU kernels with gcc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# torch first, from its own index and at the version requirements.txt pins; then the rest
# from PyPI, with torch filtered out so pip cannot swap in a different build.
COPY requirements.txt .
# The version check fails the build, not the first start, if the index gave a CPU-only build.
RUN pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' requirements.txt)" \
 && python -c "import torch; assert torch.version.cuda, 'not a CUDA build of torch'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
 && grep -v '^torch' requirements.txt > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# A new named volume copies the ownership of the directory it is mounted on, so these
# mount points decide that the non-root user can write the weights and the HF cache.
RUN groupadd --gid 1000 app \
 && useradd --create-home --uid 1000 --gid 1000 app \
 && mkdir -p /models /hf-cache \
 && chown app:app /models /hf-cache

COPY vllm_v0/ vllm_v0/
COPY rpcserver/ rpcserver/
COPY checkpoint/ checkpoint/
COPY services/__init__.py services/__init__.py
COPY services/model_worker/ services/model_worker/
COPY demo/ demo/

# Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd (deploy/kubernetes/).
USER 1000:1000
EXPOSE 50053
CMD ["python", "-m", "services.model_worker", "--host", "0.0.0.0", "--port", "50053", \
     "--model", "/models/demo", "--device", "cuda", "--dtype", "auto"]
