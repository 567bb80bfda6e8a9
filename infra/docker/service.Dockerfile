# expresslane router and coordinator: Python only, no torch, no CUDA.
#   docker build -f infra/docker/service.Dockerfile -t expresslane/service .
#   docker run expresslane/service coordinator --nats-url nats://nats:4222
# The router loads tokenizers (transformers + tokenizers, which need no torch). A router from this
# image has no vLLM: tools, structured output and logprobs take the standard lane (compose runs
# the router from the prefill image instead, docs/design/vllm-surface.md).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# Dependencies first (a source change does not reinstall them).
COPY pyproject.toml README.md ./
RUN mkdir -p shared services infra && touch shared/__init__.py services/__init__.py infra/__init__.py \
 && pip install . "transformers>=4.50" "tokenizers>=0.21" \
 && pip uninstall -y expresslane

COPY shared ./shared
COPY services ./services
COPY infra ./infra
RUN pip install --no-deps . && useradd --system --uid 10001 expresslane
USER expresslane

ENTRYPOINT ["expresslane"]
CMD ["--help"]
