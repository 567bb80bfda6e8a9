"""The fast path's package (services/decode/engine/cuda) imports on its own, with torch and Triton only, as
the GPU benchmarks load it (bench/decode_gpu.py ``load_cuda_pkg``: device hosts carry no more): no module
may import from the engine package at import time."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[3] / "services/decode/engine/cuda"
MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


@pytest.fixture(scope="module")
def standalone():
    name = "xl_cuda_standalone"
    spec = importlib.util.spec_from_file_location(name, PKG / "__init__.py", submodule_search_locations=[str(PKG)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        yield name
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_without_the_engine_package(standalone, module):
    importlib.import_module(f"{standalone}.{module}")
