"""``redsock bench floor`` on loopback: the ring and fan-in floors among local processes."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from ...errors import PeerFailure
from ...results import human_size

_CONNECT_S = 180.0  # 9 processes importing torch on 2 cores take a while
_IO_TIMEOUT_S = 120.0


def _listener() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(_CONNECT_S)
    return srv, srv.getsockname()[1]


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=_CONNECT_S)
    s.settimeout(_IO_TIMEOUT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise PeerFailure("floor: peer closed the connection")
        view = view[n:]


def _times(n: int, fn: Callable[..., object], *args: Any) -> None:
    for _ in range(n):
        fn(*args)


def run_threads(targets: list) -> None:
    """Run the callables in threads; re-raise the first error once all have stopped (every
    socket here has a timeout, so a thread whose peer failed stops too)."""
    errors: list[BaseException] = []

    def guarded(fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _gloo(rank: int, world: int, port: int):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return dist


# --------------------------------------------------------------------- ring

def _ring_rank(rank: int, world: int, sizes: list[int], warmup: int, iters: int,
               ports: dict, gloo_port: int, store_port: int, out) -> None:
    import torch

    srv, port = _listener()
    ports[rank] = port
    while len(ports) < world:
        time.sleep(0.01)
    to_next = _connect(ports[(rank + 1) % world])
    from_prev, _ = srv.accept()
    from_prev.settimeout(_IO_TIMEOUT_S)
    srv.close()
    dist = _gloo(rank, world, gloo_port)
    from ... import api  # here: the rank processes need it, the CLI parsing does not

    store = torch.distributed.TCPStore("127.0.0.1", store_port, world, rank == 0, timedelta(seconds=_CONNECT_S))
    comm = api.init(rank, world, store, algo="ring")
    rows = []
    try:
        for size in sizes:
            chunk = max(1, size // world)
            steps = 2 * (world - 1)
            send_buf = np.empty(chunk, np.uint8)
            recv_buf = np.empty(chunk, np.uint8)
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32)
            ours = np.empty(max(1, size // 4), np.float32)
            floor_t, gloo_t, ring_t, checked = [], [], [], 0
            for it in range(warmup + iters):
                send_buf[:] = it & 0xFF
                dist.barrier()
                t0 = time.perf_counter()
                run_threads([lambda: _times(steps, to_next.sendall, send_buf.data),
                             lambda: _times(steps, _recv_exact, from_prev, recv_buf.data)])
                t_floor = time.perf_counter() - t0
                if not (recv_buf == (it & 0xFF)).all():  # the bytes really moved
                    raise PeerFailure(f"floor: rank {rank} received wrong bytes in iteration {it}")
                checked += 1
                tensor.fill_(1)  # as ours below: repeated sums would grow to inf
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(tensor)
                t_gloo = time.perf_counter() - t0
                ours[:] = 1
                comm.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(ours)
                t_ring = time.perf_counter() - t0
                if not (ours == world).all():
                    raise PeerFailure(f"floor: rank {rank}: redsock ring all-reduce gave a wrong sum")
                if it >= warmup:
                    floor_t.append(t_floor)
                    gloo_t.append(t_gloo)
                    ring_t.append(t_ring)
            rows.append({"size": size, "floor_s": floor_t, "gloo_s": gloo_t, "ring_s": ring_t, "checked": checked})
        out.put((rank, rows))
    finally:
        comm.close()
        to_next.close()
        from_prev.close()
        dist.destroy_process_group()


def _busbw(size: int, world: int, t: float) -> float:
    return size / t * 2 * (world - 1) / world / 1e9


def run_ring(world: int, sizes: list[int], warmup: int, iters: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        ports = manager.dict()
        out = ctx.Queue()
        gloo_port, store_port = _free_port(), _free_port()
        procs = [ctx.Process(target=_ring_rank,
                             args=(r, world, sizes, warmup, iters, ports, gloo_port, store_port, out))
                 for r in range(world)]
        per_rank = _run_all(procs, out, world)
    results = []
    for i, size in enumerate(sizes):
        # the slowest rank counts, per iteration; then the median over iterations
        floor = statistics.median(max(per_rank[r][i]["floor_s"][k] for r in range(world)) for k in range(iters))
        gloo = statistics.median(max(per_rank[r][i]["gloo_s"][k] for r in range(world)) for k in range(iters))
        ring = statistics.median(max(per_rank[r][i]["ring_s"][k] for r in range(world)) for k in range(iters))
        results.append({"mode": "ring", "world": world, "size": size, "floor_s": floor, "gloo_s": gloo,
                        "redsock_ring_s": ring, "floor_busbw": _busbw(size, world, floor),
                        "gloo_busbw": _busbw(size, world, gloo), "redsock_ring_busbw": _busbw(size, world, ring),
                        "max_x_gloo": gloo / floor, "ring_x_gloo": gloo / ring,
                        "checked": sum(per_rank[r][i]["checked"] for r in range(world))})
    return results


# -------------------------------------------------------------------- fan-in

def accept_n(srv: socket.socket, n: int, timeout_s: float, nodelay: bool = True,
             on_accept: Callable[[socket.socket], None] | None = None) -> list[socket.socket]:
    """``n`` connections off ``srv``, each with ``timeout_s`` on its I/O and handed to ``on_accept``
    as it arrives; none left open on failure."""
    accepted: list[socket.socket] = []
    try:
        for _ in range(n):
            c, _ = srv.accept()
            accepted.append(c)
            c.settimeout(timeout_s)
            if nodelay:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if on_accept is not None:
                on_accept(c)
    except BaseException:
        for c in accepted:
            c.close()
        raise
    return accepted


def fanin_accept(srv: socket.socket, nworkers: int) -> list[socket.socket]:
    """The fan-in reducer's connections, in rank order (each worker says its rank first)."""
    conns: list[socket.socket | None] = [None] * nworkers

    def place(c: socket.socket) -> None:  # as it arrives: a bad rank fails before the rest connect
        hello = bytearray(4)
        _recv_exact(c, memoryview(hello))
        rank = struct.unpack("<i", hello)[0]
        if not 0 <= rank < nworkers or conns[rank] is not None:
            raise PeerFailure(f"floor: a worker said it is rank {rank} (of {nworkers}, or twice)")
        conns[rank] = c

    accept_n(srv, nworkers, _IO_TIMEOUT_S, on_accept=place)
    return conns  # type: ignore[return-value]


def fanin_reduce(srv: socket.socket, nworkers: int, rounds: int) -> None:
    """The fan-in reducer: takes its workers' connections off ``srv`` (then closes it); per
    round, one 8-byte integer from every worker and their sum back to each."""
    try:
        conns = fanin_accept(srv, nworkers)
    finally:
        srv.close()
    try:
        buf = bytearray(8)
        for _ in range(rounds):
            total = 0
            for c in conns:
                _recv_exact(c, memoryview(buf))
                total += struct.unpack("<q", buf)[0]
            reply = struct.pack("<q", total)
            for c in conns:
                c.sendall(reply)
    finally:
        for c in conns:
            c.close()


def fanin_join(sock: socket.socket, rank: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(struct.pack("<i", rank))


def fanin_call(sock: socket.socket, rank: int, nworkers: int, it: int, buf: bytearray) -> None:
    """Round ``it`` of the fan-in, checked: send rank + it, expect the sum over all ranks."""
    sock.sendall(struct.pack("<q", rank + it))
    _recv_exact(sock, memoryview(buf))
    got, want = struct.unpack("<q", buf)[0], nworkers * it + nworkers * (nworkers - 1) // 2
    if got != want:
        raise PeerFailure(f"floor: worker {rank} got sum {got} in round {it}, expected {want}")


def _reducer(nworkers: int, rounds: int, port_out, out) -> None:
    srv, port = _listener()
    for _ in range(nworkers):
        port_out.put(port)
    fanin_reduce(srv, nworkers, rounds)
    out.put(("reducer", rounds))


def _fanin_worker(rank: int, nworkers: int, warmup: int, iters: int, port_in, gloo_port: int, out) -> None:
    import torch

    sock = _connect(port_in.get())
    dist = None
    try:
        fanin_join(sock, rank)
        dist = _gloo(rank, nworkers, gloo_port)
        buf = bytearray(8)
        times, gloo_times = [], []
        tensor = torch.zeros(2, dtype=torch.float32)  # 8 bytes
        for it in range(warmup + iters):
            t0 = time.perf_counter()
            fanin_call(sock, rank, nworkers, it, buf)
            dt = time.perf_counter() - t0
            if it >= warmup:
                times.append(dt)
        for it in range(warmup + iters):
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            if it >= warmup:
                gloo_times.append(time.perf_counter() - t0)
        out.put((rank, {"floor_s": times, "gloo_s": gloo_times}))
    finally:
        sock.close()
        if dist is not None:
            dist.destroy_process_group()


def run_fanin(nworkers: int, warmup: int, iters: int) -> dict:
    ctx = mp.get_context("spawn")
    out, port_q = ctx.Queue(), ctx.Queue()
    gloo_port = _free_port()
    procs = [ctx.Process(target=_reducer, args=(nworkers, warmup + iters, port_q, out))]
    procs += [ctx.Process(target=_fanin_worker, args=(r, nworkers, warmup, iters, port_q, gloo_port, out))
              for r in range(nworkers)]
    got = _run_all(procs, out, nworkers + 1)
    floor = statistics.median(max(got[r]["floor_s"][k] for r in range(nworkers)) for k in range(iters))
    gloo = statistics.median(max(got[r]["gloo_s"][k] for r in range(nworkers)) for k in range(iters))
    return {"mode": "fanin", "workers": nworkers, "floor_us": floor * 1e6, "gloo_us": gloo * 1e6,
            "checked": got["reducer"]}


# -------------------------------------------------------------------- common

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_all(procs, out, n: int, timeout_s: float = 600.0) -> dict:
    """Start ``procs``, collect ``n`` results; any process that dies first fails the run (no hang)."""
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < n:
            try:
                key, value = out.get(timeout=0.5)
                got[key] = value
            except Exception:  # queue.Empty: see whether someone died
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise PeerFailure(f"floor: a process failed (exit {dead[0].exitcode})") from None
                if time.monotonic() > deadline:
                    raise PeerFailure(f"floor: no result within {timeout_s:.0f} s") from None
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return got


def run_loopback(args: argparse.Namespace, sizes: list[int], workers: list[int]) -> int:
    results: list[dict] = []
    if args.mode in ("ring", "both"):
        print(f"# ring floor: {args.nprocs} ranks on loopback stream 2(N-1)/N x size each way with plain "
              f"sockets, no arithmetic; gloo all-reduce (float32 sum) timed in the same processes", flush=True)
        print("# floor/gloo = the most any TCP all-reduce can gain over gloo here; redsock ring (checked) alongside")
        print("#     size   floor(us) floor busbw   gloo(us) gloo busbw  floor/gloo   ring(us) ring busbw  ring/gloo",
              flush=True)
        for row in run_ring(args.nprocs, sizes, args.warmup, args.iters):
            results.append(row)
            print(f"{human_size(row['size']):>10} {row['floor_s'] * 1e6:11.0f} {row['floor_busbw']:11.3f} "
                  f"{row['gloo_s'] * 1e6:10.0f} {row['gloo_busbw']:10.3f} {row['max_x_gloo']:10.2f}x "
                  f"{row['redsock_ring_s'] * 1e6:10.0f} {row['redsock_ring_busbw']:10.3f} "
                  f"{row['ring_x_gloo']:9.2f}x", flush=True)
    if args.mode in ("fanin", "both"):
        print("# fan-in floor: N workers send 8 bytes to one reducer process, which sends the sum back "
              "to each (plain sockets, checked); gloo 8-byte all-reduce among the same workers", flush=True)
        print("#  workers  floor(us)  x first    gloo(us)  x first", flush=True)
        first = None
        for n in workers:
            row = run_fanin(n, args.warmup * 50, args.iters * 100)
            first = first or row
            results.append(row)
            print(f"{n:10d} {row['floor_us']:10.1f} {row['floor_us'] / first['floor_us']:8.2f} "
                  f"{row['gloo_us']:11.1f} {row['gloo_us'] / first['gloo_us']:8.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0

