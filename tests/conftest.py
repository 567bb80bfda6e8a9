"""Session-wide fixtures: a real nats-server, tiny models, real vLLM servers (started once)."""

pytest_plugins = [
    "tests.fixtures.nats",
    "tests.fixtures.models",
    "tests.fixtures.vllm",
    "tests.fixtures.prefill",
    "tests.fixtures.otlp",
]
