import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ASSETS = Path(__file__).parent / "assets"

# The tiny models are far faster on one thread than on two fighting over a 2-core machine.
torch.set_num_threads(1)

# Shared-memory names the project creates: Python's SharedMemory segments (the aux ring, its
# release counter, the control channel) and the channel's FIFO directories.
SHM_DIR, SHM_PREFIXES = Path("/dev/shm"), ("psm_", "dflash-")


def shm_names() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIXES)}


def pytest_sessionstart(session):
    session.config.stash[SHM_KEY] = shm_names()


def pytest_sessionfinish(session, exitstatus):
    """A run that leaves shared-memory names behind fails: every engine start, restart, kill
    and shutdown in the suite must unlink what it created."""
    leaked = shm_names() - session.config.stash.get(SHM_KEY, set())
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"FAILED: the run left {len(leaked)} names in {SHM_DIR}: "
                                f"{sorted(leaked)[:8]}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


SHM_KEY = pytest.StashKey[set]()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A directory with target/, target-published/, target-bf16/, draft-full/, draft-swa/
    (tools.tiny_models.write_all), written once per session."""
    from tools.tiny_models import write_all

    root = tmp_path_factory.mktemp("tiny_models")
    write_all(root)
    return root


@pytest.fixture(scope="session")
def tiny_demo() -> tuple[Path, Path]:
    """The committed (target, draft) pair whose draft was trained on that target."""
    target, draft = ASSETS / "tiny" / "target", ASSETS / "tiny" / "draft"
    for path in (target, draft):
        if not (path / "config.json").exists():
            pytest.fail(f"missing test asset {path}; see tests/assets/README.md")
    return target, draft


def pytest_collection_finish(session):
    """The Triton tests' interpreter children start now, beside the whole run
    (tests/target/triton_child.py)."""
    import sys

    triton_child = sys.modules.get("triton_child")  # imported by the files that have children
    if triton_child is not None:
        triton_child.queue_session(list(dict.fromkeys(str(item.path) for item in session.items)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the session: fake GPUs are enough for placement on CPU."""
    import ray

    # Fake GPUs for placement on CPU; the real ones where there are (fake ones would hand
    # actors CUDA_VISIBLE_DEVICES of GPUs that do not exist).
    num_gpus = torch.cuda.device_count() or 4
    ray.init(num_cpus=8, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
