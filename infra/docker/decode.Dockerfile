# expresslane decode node: our decode engine on a PyTorch CUDA base, Mooncake and NIXL for the
# one-sided KV writes.
#   docker build -f infra/docker/decode.Dockerfile -t expresslane/decode .
#   docker run --gpus all expresslane/decode decode --model /models/m --device cuda --node-id decode-0
# Set TORCH_IMAGE to the PyTorch/CUDA image that matches the host's driver.
ARG TORCH_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${TORCH_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NIXL_LOG_LEVEL=WARN
# Mooncake's transfer engine links libibverbs (RDMA); not ibverbs-providers' extra recommends.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app

COPY pyproject.toml README.md ./
RUN mkdir -p shared services infra && touch shared/__init__.py services/__init__.py infra/__init__.py \
 && pip install . "mooncake-transfer-engine==0.3.13.post1" "nixl==1.5.1" "tokenizers>=0.21" \
 && pip uninstall -y expresslane

COPY shared ./shared
COPY services ./services
COPY infra ./infra
RUN pip install --no-deps .

ENTRYPOINT ["expresslane"]
CMD ["decode", "--help"]
