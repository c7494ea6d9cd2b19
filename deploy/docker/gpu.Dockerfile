# kvtier server image for GPU nodes: Dockerfile plus the `gpu` extra (cupy-cuda12x), which the copier
# processes (one per GPU) use. Build from the repository root:
#   docker build -f deploy/docker/gpu.Dockerfile -t kvtier-gpu:0.1.0 .
# Run it with deploy/docker/compose.gpu.yaml or deploy/kubernetes/gpu/kvtier-daemonset.yaml.
# No CUDA base image: the cupy-cuda12x wheel links the CUDA runtime statically and opens libcuda.so.1 at
# run time (checked in the 14.2.0 wheel), and the NVIDIA container runtime mounts the driver's libcuda.so.1
# (NVIDIA_DRIVER_CAPABILITIES=compute,utility). UNVERIFIED: this image has not been built or run on a GPU.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package build needs, so a docs change does not invalidate the install layer.
COPY pyproject.toml README.md /src/
COPY server /src/server
COPY connector /src/connector
COPY shm /src/shm
COPY admin_api /src/admin_api
RUN pip install "/src[gpu]" && rm -rf /src \
    && groupadd --system --gid 10001 kvtier \
    && useradd --system --uid 10001 --gid kvtier --home-dir /nonexistent --shell /usr/sbin/nologin kvtier

# The same defaults as `kvtier server` (docs/configuration.md); override with -e KVTIER_...=.
# Loopback binds: clients share this container's network namespace (compose: network_mode: service:kvtier).
ENV KVTIER_HOST=127.0.0.1 \
    KVTIER_PORT=5555 \
    KVTIER_HTTP_HOST=127.0.0.1 \
    KVTIER_HTTP_PORT=8080 \
    KVTIER_L1_SIZE_GB=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER 10001:10001
EXPOSE 5555 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVTIER_HTTP_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["kvtier", "server"]
