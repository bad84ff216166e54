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



def throttled_stream(rate: str, nbytes: str, balance: str = "dynamic") -> None:
    """Inside a fresh namespace: throttle data stream 0 on `lo` with htb, send, report JSON."""
    import json
    import subprocess
    import time

    from redsock.transport import Listener

    cfg = Config(nsocks=4, local_nsocks=0, chunk_bytes=64 * 1024, balance=balance, timeout_s=60)
    with Listener("127.0.0.1", 0, config=cfg) as listener:
        client = connect(listener.address, config=cfg, name="client")
        server = listener.accept(10)
        sport = client._data[0].getsockname()[1]
        for cmd in (["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10"],
                    ["tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "20gbit"],
                    ["tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", rate],
                    ["tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "sport", str(sport), "0xffff", "flowid", "1:20"]):
            subprocess.run(cmd, check=True, capture_output=True)
        data = pattern(int(nbytes), 7)
        out = np.empty_like(data)
        t0 = time.perf_counter()
        h = server.irecv(out, 1)
        client.send(data, 1)
        h.wait(60)
        elapsed = time.perf_counter() - t0
        print(json.dumps({"elapsed": elapsed, "intact": bool(np.array_equal(out, data)),
                          "slices": client.slices_sent, "bytes": client.bytes_sent}), flush=True)
        client.close()
        server.close()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
