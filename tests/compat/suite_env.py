"""The environment torch's suite reads, set by the runner before it imports ``suite``."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

GATE = "REDSOCK_COMPAT_GATE"  # the runner's own variables (not redsock options)
START = "REDSOCK_COMPAT_START"


def prepare_environment(backend: str, world_size: int, *, gate: str | None = None, start_method: str = "forkserver",
                        test_timeout: int = 180) -> None:
    """The parent's environment, inherited by the ranks; call it before importing ``suite``."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(test_timeout)
    tmp = tempfile.mkdtemp(prefix="redsock-compat-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    os.environ["TEMP_DIR"] = tmp
    os.environ["INIT_METHOD"] = f"file://{tmp}/init"  # the suite uses its own per-test file (not env://)
    Path(tmp, "barrier").mkdir(exist_ok=True)
    # Python 3.11's forkserver ignores the parent's sys.path: it finds ``suite`` through this.
    here = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    os.environ[START] = start_method
    if gate:
        os.environ[GATE] = gate
    else:
        os.environ.pop(GATE, None)
