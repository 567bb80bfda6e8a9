"""When the router says it is ready: prefill discovered, and vLLM's serving code loaded where it is wanted."""

from __future__ import annotations

import pytest

from services.router import app, vllm_surface
from services.router.app import Router
from services.router.config import RouterConfig

URL = "http://vllm"

# (mode, parsers, vLLM importable, surface state after its load, ready)
CASES = {
    "off: never waits": ("off", False, True, "loading", True),
    "auto, vLLM here, still importing: starting": ("auto", False, True, "loading", False),
    "auto, vLLM here, loaded": ("auto", False, True, "loaded", True),
    "auto, vLLM here, import failed: ready without it": ("auto", False, True, "failed", True),
    "auto, no vLLM: nothing to wait for": ("auto", False, False, "loading", True),
    "auto, import hanging past the wait: ready without it": ("auto", False, True, "hanging", True),
    "on, import hanging: still starting": ("on", False, True, "hanging", False),
    "on, importing: starting": ("on", False, True, "loading", False),
    "on, import failed: never ready": ("on", False, True, "failed", False),
    "on, loaded": ("on", False, True, "loaded", True),
    "parsers, import failed: never ready": ("auto", True, True, "failed", False),
    "parsers, loaded": ("auto", True, True, "loaded", True),
}


@pytest.mark.parametrize("mode,parsers,importable,state,ready", list(CASES.values()), ids=list(CASES))
async def test_ready_waits_for_the_surface_where_wanted(monkeypatch, mode, parsers, importable, state, ready):
    monkeypatch.setattr(vllm_surface, "available", lambda: importable)
    cfg = RouterConfig(prefill_urls=(URL,), nats_url="nats://127.0.0.1:1", vllm_surface=mode,
                       tool_call_parser="hermes" if parsers else None)
    router = Router(cfg)
    try:
        router.discovered.add(URL)
        router.surface.ready = state == "loaded"
        router.surface.error = "ImportError: boom" if state == "failed" else ""
        if state == "hanging":  # the load began longer ago than the router waits for it
            router._surface_load_started -= app.SURFACE_READY_WAIT_S + 1
        assert router.is_ready is ready
        router.discovered.clear()  # and never before the prefill is discovered
        assert router.is_ready is False
    finally:
        await router.http.aclose()
