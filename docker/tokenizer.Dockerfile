# The tokenizer service: text <-> token ids and chat templating, on CPU, without torch.
# Build from the repository root: docker build -f docker/tokenizer.Dockerfile .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/hf-cache

WORKDIR /app

# The same pins as CI, less torch: tokenizing never touches it.
COPY requirements.txt .
RUN grep -v '^torch' requirements.txt > /tmp/requirements.txt \
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
COPY services/tokenizer/ services/tokenizer/

# Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd (deploy/kubernetes/).
USER 1000:1000
EXPOSE 50052
CMD ["python", "-m", "services.tokenizer", "--host", "0.0.0.0", "--port", "50052", "--model", "/models/demo"]
