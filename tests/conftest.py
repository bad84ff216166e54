import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from redsock.config import Config
from redsock.transport import Listener, connect

TESTS = Path(__file__).parent


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
