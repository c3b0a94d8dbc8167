# The gateway: the public gRPC API, and the OpenAI-compatible HTTP API with --http-port. It
# validates, tokenizes (through the tokenizer service) and streams from the worker, so it needs neither torch nor the weights.
# Build from the repository root: docker build -f docker/gateway.Dockerfile .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The same pins as CI, less torch: nothing this service imports needs it, and it is the
# largest download by far. Installed before the code so code edits reuse this layer.
COPY requirements.txt .
RUN grep -v '^torch' requirements.txt > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

RUN groupadd --gid 1000 app \
 && useradd --create-home --uid 1000 --gid 1000 app

COPY vllm_v0/ vllm_v0/
COPY rpcserver/ rpcserver/
COPY gateway/ gateway/

# Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd (deploy/kubernetes/).
USER 1000:1000
EXPOSE 50051 8000
# Exec form: the server itself is PID 1 and gets SIGTERM to drain its streams.
CMD ["python", "-m", "gateway", "--host", "0.0.0.0", "--port", "50051"]
