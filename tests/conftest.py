import sys
from pathlib import Path

import pytest

# tests import their shared fixtures (tiny_models, ...) as plain modules
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption("--run-long", action="store_true",
                     help="also run the tests marked long (the fuzzers' long runs)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--run-long"):
        long = pytest.mark.skip(reason="a long run: pass --run-long")
        for item in items:
            if "long" in item.keywords:
                item.add_marker(long)
    from pantheon.worker.device import cuda_available
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible to CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_amx():
    """Products of any number of rows keep the integer and BLAS paths (where a test is
    about those paths' own properties), then the AMX tiles come back for the next test."""
    from pantheon.worker import kernels_cpu
    with kernels_cpu.options(amx=0):
        yield


AGENT_KEY = "sk-agent-apis"


@pytest.fixture(scope="session")
def agent_server():
    """One server on the default model for the agent APIs' end-to-end tests (Messages,
    Responses, tokenize, embeddings), with an API key: started once for all of them."""
    from cluster import Server
    with Server("--slots", "4", "--ctx", "1024", "--responses-ttl", "30",
                api_key=AGENT_KEY) as srv:
        yield srv
