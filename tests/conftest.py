"""Session-wide fixtures: a real nats-server, tiny models, real vLLM servers (started once)."""

pytest_plugins = [
    "tests.fixtures.nats",
    "tests.fixtures.models",
    "tests.fixtures.vllm",
    "tests.fixtures.prefill",
    "tests.fixtures.otlp",
    "tests.fixtures.vllm_plan",
]


def pytest_collection_modifyitems(session, config, items):
    from tests.fixtures.vllm_plan import order_items

    order_items(items)
