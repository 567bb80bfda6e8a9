# expresslane prefill: the official vLLM image, unpatched, plus this package, so that vLLM loads
# the express connector through kv_connector_module_path (`expresslane prefill` builds the
# command line and starts `vllm serve`).
#   docker build -f infra/docker/prefill.Dockerfile -t expresslane/prefill .
#   docker run --gpus all expresslane/prefill prefill --model /models/m --host 0.0.0.0
# The vLLM version must be the one of the `gpu` extra in pyproject.toml (one connector API).
# compose also runs the router from this image: vLLM's tool/reasoning parsers and response
# rendering for tools, structured output and logprobs (docs/design/vllm-surface.md).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NIXL_LOG_LEVEL=WARN
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/expresslane

# Our light dependencies only: torch, vLLM and NIXL stay exactly as the image ships them.
COPY pyproject.toml README.md ./
RUN mkdir -p shared services infra && touch shared/__init__.py services/__init__.py infra/__init__.py \
 && pip install --no-deps "nats-py==2.16.0" "msgspec==0.23.0" \
      "structlog==26.1.0" "mooncake-transfer-engine==0.3.13.post1" \
 && pip install "opentelemetry-sdk>=1.45" "opentelemetry-exporter-otlp-proto-http>=1.45" \
      "opentelemetry-proto>=1.45" prometheus-client

COPY shared ./shared
COPY services ./services
COPY infra ./infra
RUN pip install --no-deps . && python3 -c "import services.prefill.connector, services.router.app, vllm"

ENTRYPOINT ["expresslane"]
CMD ["prefill", "--help"]
