# syntax=docker/dockerfile:1
# mimo-epd container image (docs/deploy.md). One image for every role: the router, the encoder and LLM nodes
# (`serve --join`) and the Mooncake master (the wheel's `mooncake_master`); the command picks the role.
#   docker build -t mimo-epd:cpu .                                   CPU torch wheels
#   docker build -t mimo-epd:cuda --build-arg VARIANT=cuda .         CUDA torch wheels (driver from the host)
# Stage 1 builds the virtual environment; stage 2 copies it into a slim runtime that runs as a non-root user.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
# cpu: PyTorch's CPU-only index (no CUDA libraries in the image); cuda: PyPI's default wheels, which carry
# their CUDA runtime (the GPU driver comes from the node through the NVIDIA container runtime).
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_CUDA=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mimo_epd ./mimo_epd
COPY encoder_server ./encoder_server
COPY llm_backend ./llm_backend
COPY shm_cache ./shm_cache
COPY loadtest ./loadtest
# The project pins its dependencies in pyproject.toml (torch==, grpcio>=, ...); `.` installs exactly those.
RUN if [ "$VARIANT" = "cuda" ]; then index="$TORCH_INDEX_CUDA"; else index="$TORCH_INDEX_CPU"; fi \
    && /opt/venv/bin/pip install --extra-index-url "$index" . \
    && /opt/venv/bin/mimo-epd version

FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="mimo-epd" \
      org.opencontainers.image.description="Encoder / Prefill / Decode serving stack (${VARIANT})"
# Mooncake's transfer engine links libibverbs, libnuma and libcurl even over TCP. Debian's security updates
# keep these packages current within bookworm, so their versions are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin mimo
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MIMO_HEALTH_ADDR=127.0.0.1:50051
USER 10001
WORKDIR /home/mimo
# gRPC (router, node health), the router's HTTP API, Prometheus metrics
EXPOSE 50051 8000 9100
# The gRPC health service of whatever runs on MIMO_HEALTH_ADDR (the router, or a joined node's health port).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["sh", "-c", "exec mimo-epd health --server \"$MIMO_HEALTH_ADDR\" --timeout 3"]
ENTRYPOINT ["mimo-epd"]
CMD ["serve", "--host", "0.0.0.0"]
