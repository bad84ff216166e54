import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from redsock.config import Config
from redsock.transport import Listener, connect

TESTS = Path(__file__).parent
#: What a launcher (torchrun, mpirun) tells a rank: the tests' child processes inherit the
#: environment, and one left set makes every later rank join another world (it hung a
#: Lightning run once).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture(autouse=True)
def _no_launcher_variable_left_behind():
    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    yield
    after = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    assert after == before, f"the test left the launcher's variables changed: {before} -> {after}"


@pytest.fixture
def make_pair():
    """make_pair(**config) -> (client, server) Connections over loopback; closed afterwards."""
    made = []

    def make(**overrides):
        # local_nsocks=0: these tests exercise the multi-stream path, over loopback
        cfg = Config.from_env(**{"timeout_s": 20.0, "local_nsocks": 0, **overrides})
        listener = Listener(config=cfg)
        client = connect(listener.address, config=cfg, name="client")
        server = listener.accept(timeout=10)
        made.extend([client, server, listener])
        return client, server

    yield make
    for obj in made:
        obj.close()


def spawn_peer(*args, env=None):
    """Start tests/peer_programs.py in a child process; waits for its "ready" line."""
    proc = subprocess.Popen([sys.executable, str(TESTS / "peer_programs.py"), *map(str, args)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    return proc


def wait_line(proc, expected, timeout=30):
    """Read lines from proc.stdout until `expected`, with a deadline (never hangs)."""
    result = {}

    def reader():
        for line in proc.stdout:
            if line.strip() == expected:
                result["ok"] = True
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        proc.kill()
        raise AssertionError(f"peer never printed {expected!r}")
