"""Peer processes for multi-process transport tests: ``python peer_programs.py NAME ARGS...``.

Each prints "ready" once connected so the test knows when to act (kill, stop).
"""

import sys

import numpy as np

from redsock.config import Config
from redsock.transport import connect


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sender(host: str, port: str, nbytes: str, timeout: str = "30") -> None:
    cfg = Config.from_env(timeout_s=float(timeout))
    with connect((host, int(port)), config=cfg, name="sender") as conn:
        data = pattern(int(nbytes), 1)
        print("ready", flush=True)
        conn.send(data, tag=5)
        print("sent", flush=True)


def receiver(host: str, port: str, nbytes: str, timeout: str = "30") -> None:
    cfg = Config.from_env(timeout_s=float(timeout))
    with connect((host, int(port)), config=cfg, name="receiver") as conn:
        buf = np.empty(int(nbytes), np.uint8)
        print("ready", flush=True)
        conn.recv(buf, tag=6)
        print("received", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
