"""The ``redsock`` torch.distributed backend: every operation against gloo in the same
processes, subgroups, async work, autoload at ``import torch``, failures, and DDP training
(ring, reduction servers, and the comm hook) against the same training on gloo."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from redsock.bench.procs import start_logged, stop_processes, wait_logged
from redsock.errors import ConfigError
from test_server import start_reducer

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

TESTS = Path(__file__).parent
WORKER = TESTS / "torch_worker.py"
TRAIN = TESTS.parent / "examples" / "train_lm.py"
# Small enough that 3 ranks x 20 steps take seconds on 2 cores; the 100 KB buckets make
# DDP send several all-reduces per step (about 160 K parameters).
SMALL_LM = ["--steps", "20", "--warmup", "0", "--vocab", "512", "--d-model", "64", "--layers", "2",
            "--heads", "2", "--seq-len", "32", "--batch-size", "2", "--optimizer", "sgd",
            "--bucket-cap-mb", "0.1", "--log-every", "1000"]


def launch(argv: list[str], world: int, env: dict[str, str] | None = None,
           timeout: float = 120) -> list[tuple[int, str, str]]:
    """Run ``python argv...`` as ``world`` ranks with torchrun's variables; the store is
    hosted here (as torchrun's agent does), so no port is picked twice.  Returns
    (returncode, stdout, stderr) per rank; never hangs past ``timeout``."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=60),
                     wait_for_workers=False)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(world), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [start_logged([sys.executable, *argv], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(world)]
    try:
        outs = wait_logged(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def check_ok(outs: list[tuple[int, str, str]]) -> None:
    """Every rank exited 0 and printed ``ok`` last; otherwise show every rank's stderr."""
    bad = [r for r, (code, out, _) in enumerate(outs) if code != 0 or not out.rstrip().endswith("ok")]
    if bad:
        report = "\n".join(f"--- rank {r} (exit {code}) stdout:\n{out[-2000:]}\nstderr:\n{err[-6000:]}"
                           for r, (code, out, err) in enumerate(outs))
        pytest.fail(f"ranks {bad} failed:\n{report}")


def worker(scenario: str, world: int, **kw) -> list[tuple[int, str, str]]:
    return launch([str(WORKER), scenario], world, **kw)


# -- operations against gloo ---------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 3])
def test_every_operation_matches_gloo(world):
    check_ok(worker("ops", world))


def test_async_work_and_futures():
    check_ok(worker("async", 3))


@pytest.mark.parametrize("path", ["ring", "reducers", "shm"])
def test_a_future_callback_may_wait_for_a_nested_collective(path, request):
    """gloo and NCCL run then() callbacks where a nested collective can still progress;
    redsock too, whichever path carries the data."""
    env = {"ring": {"REDSOCK_ALGO": "ring", "REDSOCK_SHM": "off"},
           "shm": {"REDSOCK_SHM": "auto"},  # one host, several ranks: the arena
           "reducers": lambda: {"REDSOCK_SERVERS": request.getfixturevalue("reducers"), "REDSOCK_ALGO": "server",
                                "REDSOCK_PIECE_BYTES": "64K", "REDSOCK_SHM": "off"}}[path]
    env = env() if callable(env) else env
    check_ok(worker("nested", 3, env={**env, "TEST_TIMEOUT_S": "30"}, timeout=90))


def test_subgroups_each_with_their_own_communicator():
    check_ok(worker("subgroups", 3))


def test_dead_rank_fails_the_others_work_with_peer_failure():
    t0 = time.monotonic()
    outs = worker("failure", 3, env={"TEST_TIMEOUT_S": "20"}, timeout=90)
    assert outs[2][0] == 9, outs[2][2][-3000:]
    check_ok(outs[:2])
    for _, out, _ in outs[:2]:
        assert "raised PeerFailure ranks=[2]" in out, out
        assert "then raised PeerFailure" in out, out
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("op", [0, 1], ids=["allreduce", "broadcast"])
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_per_call_timeout_of_the_options_bounds_the_call(op, shm):
    # The group's timeout is 60 s; the options' 1 s fails the call within a few seconds,
    # through shared memory (two ranks on this host) and over Fast Socket alike.
    outs = worker("per_call_timeout", 2, env={"TEST_TIMEOUT_S": "60", "TEST_SLEEP_S": "6", "TEST_OP": str(op),
                                               "REDSOCK_SHM": shm}, timeout=90)
    check_ok(outs)
    line = next((ln for ln in outs[0][1].splitlines() if " raised " in ln), outs[0][1])
    took = float(line.split(" after ")[1].split("s:")[0])
    assert took < 6, line
    # (either waits one more period, at most RELAY_GRACE_S, while the peer is alive: its diagnosis
    # of somebody else's failure would come within it)
    assert "within 2s" in line or "no progress for 2s; the call's timeout" in line, line


# -- registration ---------------------------------------------------------------------------

def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "redsock" for ep in entry_points(group="torch.backends"))


@pytest.mark.skipif(not _entry_point_installed(), reason="redsock is not installed (pip install -e .)")
def test_import_torch_alone_registers_redsock():
    probe = ("import sys, torch, torch.distributed as dist; "
             "print('redsock' in dist.Backend.backend_list, 'redsock.torch.backend' in sys.modules, "
             "dist.Backend.default_device_backend_map['cpu'])")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    # registered, without importing the heavy modules, and gloo stays the default for cpu
    assert out.stdout.split() == ["True", "False", "gloo"], out.stdout + out.stderr
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert off.stdout.split()[0] == "False", "registered without the entry point?"


def test_autoload_logs_instead_of_breaking_import_torch(monkeypatch, caplog):
    from redsock.torch import registration

    def broken() -> None:
        raise RuntimeError("simulated registration failure")

    monkeypatch.setattr(registration, "register", broken)
    with caplog.at_level(logging.WARNING, logger="redsock.torch"):
        registration.autoload()  # must not raise
    assert "could not register" in caplog.text and "simulated registration failure" in caplog.text


def test_single_rank_group_in_process_and_clear_errors():
    import redsock.torch
    from redsock.errors import ConfigError

    store = dist.HashStore()
    dist.init_process_group("redsock", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, redsock.torch.ProcessGroupRedsock) and pg.getBackendName() == "redsock"
        x = torch.arange(6, dtype=torch.bfloat16)
        work = dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True)
        assert work.wait(timeout=timedelta(seconds=10)) and torch.equal(x, torch.arange(6, dtype=torch.bfloat16))
        assert work.get_future().value()[0] is x
        with pytest.raises(ConfigError, match="BXOR is not supported"):
            dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BXOR)
        with pytest.raises(ConfigError, match="no other rank can send"):  # at once, not after the timeout
            dist.recv(torch.ones(2))
        with pytest.raises(ConfigError, match="pg_options must be"):
            dist.new_group([0], backend="redsock", pg_options=42)
        sub = dist.new_group([0], backend="redsock", timeout=timedelta(seconds=12),
                             pg_options=redsock.torch.Options(algo="ring", nsocks=2))
        assert sub.comm.config.nsocks == 2 and sub.comm.config.algo == "ring"
        # torch's timeout becomes redsock's
        assert pg.comm.config.timeout_s == 30 and sub.comm.config.timeout_s == 12
        assert sub.comm is not pg.comm and sub.group_name != pg.group_name
    finally:
        dist.destroy_process_group()


def test_a_waited_work_has_its_future_set_even_while_callbacks_run():
    """Futures are set on a delivery thread (callbacks may wait for collectives); wait() still
    returns only once the future is set, as gloo's does, so reading the value right after
    wait() works even while an earlier Work's callback holds the delivery thread."""
    import redsock.torch  # noqa: F401

    dist.init_process_group("redsock", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        # as an earlier Work's slow callback would: hold the in-order delivery thread a while
        busy = dist.group.WORLD._tracker._in_order.submit(time.sleep, 0.5)
        x = torch.arange(4, dtype=torch.float32)
        work = dist.all_reduce(x, async_op=True)
        assert work.wait()
        assert work.get_future().value()[0] is x
        busy.result()
    finally:
        dist.destroy_process_group()


def test_a_collective_c10d_waits_for_runs_in_the_callers_thread():
    """``async_op=False`` (c10d says so in ``opts.asyncOp``): the communicator is called
    synchronously from the caller's thread, and its failure is the Work's, raised by
    dist.all_reduce; async calls (and DDP's, whose options keep the default) still go to
    the communicator's thread."""
    import redsock.torch  # noqa: F401
    from redsock.errors import PeerFailure

    dist.init_process_group("redsock", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        comm = dist.group.WORLD.comm
        calls = []
        real = comm.all_reduce

        def spy(array, op="sum", algorithm=None, async_op=False):
            calls.append((threading.get_ident(), async_op))
            return real(array, op, algorithm, async_op)

        comm.all_reduce = spy
        x = torch.arange(4, dtype=torch.float32)
        dist.all_reduce(x)
        dist.reduce(x, dst=0)
        assert calls == [(threading.get_ident(), False)] * 2
        assert comm._executor is None  # the communicator's thread never started
        calls.clear()
        dist.all_reduce(x, async_op=True).wait()
        assert calls == [(threading.get_ident(), True)] and comm._executor is not None
        opts = dist.AllreduceOptions()
        assert opts.asyncOp is True  # what a caller that does not say (DDP's reducer) gets
        assert torch.equal(x, torch.arange(4, dtype=torch.float32))

        def fails(array, op="sum", algorithm=None, async_op=False):
            raise PeerFailure("rank 1 died", ranks=(1,))

        comm.all_reduce = fails
        with pytest.raises(PeerFailure, match="rank 1 died"):
            dist.all_reduce(x)
        del comm.all_reduce
    finally:
        dist.destroy_process_group()


# -- DDP training ------------------------------------------------------------------------------

def train(tmp_path: Path, name: str, backend: str, *, hook: str = "none", env: dict[str, str] | None = None,
          world: int = 3, extra: tuple[str, ...] = ()) -> list[dict[str, torch.Tensor]]:
    """Train the example LM (small) on ``world`` ranks; returns each rank's final parameters."""
    files = str(tmp_path / f"{name}_{{rank}}.pt")
    outs = launch([str(TRAIN), "--backend", backend, "--hook", hook, *SMALL_LM, *extra, "--save-params", files],
                  world, env=env, timeout=150)
    for r, (code, out, err) in enumerate(outs):
        assert code == 0, f"{name}: rank {r} failed:\n{out[-2000:]}\n{err[-6000:]}"
    return [torch.load(files.replace("{rank}", str(r))) for r in range(world)]


def assert_identical_across_ranks(params: list[dict[str, torch.Tensor]], name: str) -> None:
    for r, p in enumerate(params[1:], 1):
        for k, v in p.items():
            assert torch.equal(v, params[0][k]), f"{name}: rank {r} differs from rank 0 in {k} (bitwise)"


def assert_close_to(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], name: str) -> None:
    assert params.keys() == ref.keys()
    for k in ref:
        # different summation orders: float rounding only, after 20 SGD steps
        torch.testing.assert_close(params[k], ref[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")


@pytest.fixture(scope="module")
def gloo_params(tmp_path_factory):
    params = train(tmp_path_factory.mktemp("gloo"), "gloo", "gloo")
    assert_identical_across_ranks(params, "gloo")
    return params[0]


@pytest.fixture
def reducers():
    """Two `redsock serve` processes on loopback; yields "host:port,host:port"."""
    procs, addrs = [], []
    try:
        for _ in range(2):
            p, addr = start_reducer()
            procs.append(p)
            addrs.append(addr)
        yield ",".join(addrs)
    finally:
        stop_processes(procs)


def test_ddp_on_redsock_ring_matches_gloo(tmp_path, gloo_params):
    params = train(tmp_path, "ring", "redsock", env={"REDSOCK_ALGO": "ring"})
    assert_identical_across_ranks(params, "redsock ring")
    assert_close_to(params[0], gloo_params, "redsock ring")


def test_ddp_through_reduction_servers_matches_gloo(tmp_path, gloo_params, reducers):
    params = train(tmp_path, "servers", "redsock",
                   env={"REDSOCK_SERVERS": reducers, "REDSOCK_ALGO": "server", "REDSOCK_PIECE_BYTES": "16K"})
    assert_identical_across_ranks(params, "redsock servers")
    assert_close_to(params[0], gloo_params, "redsock servers")


def test_ddp_comm_hook_on_a_gloo_job_matches_gloo(tmp_path, gloo_params):
    params = train(tmp_path, "hook", "gloo", hook="redsock", env={"REDSOCK_ALGO": "ring"})
    assert_identical_across_ranks(params, "gloo + redsock hook")
    assert_close_to(params[0], gloo_params, "gloo + redsock hook")


@pytest.mark.parametrize("path", ["ring", "shm"])
def test_torch_powersgd_hook_trains_to_gloos_result_bitwise(tmp_path, path):
    """torch's PowerSGD hook waits inside future callbacks for the all-reduces it starts;
    from step 2 on every step does. With 2 ranks a sum has one rounding whatever the
    algorithm, so redsock must give gloo's parameters bit for bit after 10 steps.  One
    bucket: with several, gloo runs two buckets' callbacks at once on its two threads, their
    nested all-reduces go out in different orders on different ranks, and gloo aborts
    ("collective mismatch"); redsock delivers top-level futures in order (torch/work.py)."""
    env = {"ring": {"REDSOCK_ALGO": "ring", "REDSOCK_SHM": "off"}, "shm": {"REDSOCK_SHM": "auto"}}[path]
    steps = ("--steps", "10", "--bucket-cap-mb", "25")
    ref = train(tmp_path, "powersgd_gloo", "gloo", hook="powersgd", world=2, extra=steps)
    got = train(tmp_path, "powersgd_redsock", "redsock", hook="powersgd", world=2, extra=steps, env=env)
    assert_identical_across_ranks(got, "redsock + PowerSGD")
    for k, v in ref[0].items():
        assert torch.equal(got[0][k], v), f"redsock + PowerSGD differs from gloo + PowerSGD in {k}"


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_compress_hook_keeps_ranks_identical_and_near_float32(tmp_path, gloo_params, reducers, wire):
    """The 16-bit wire through the reducers with error feedback: every rank the same bits,
    the parameters near float32 training's (bf16 rounds at 2^-9 relative, so not bitwise)."""
    params = train(tmp_path, f"compress-{wire}", "gloo", hook="compress", extra=("--wire", wire),
                   env={"REDSOCK_SERVERS": reducers, "REDSOCK_ALGO": "server", "REDSOCK_PIECE_BYTES": "16K"})
    assert_identical_across_ranks(params, f"compress {wire}")
    differ = 0
    for k, ref in gloo_params.items():
        torch.testing.assert_close(params[0][k], ref, rtol=2e-2, atol=2e-3, msg=lambda m: f"compress {wire} {k}: {m}")
        differ += not torch.equal(params[0][k], ref)
    assert differ, "the 16-bit wire changed nothing: was it used?"


def test_compress_hook_refuses_what_it_cannot_carry():
    from redsock.torch import compress_hook

    for bad in ("off", "fp32", "int8"):
        with pytest.raises(ConfigError, match="bf16 or fp16"):
            compress_hook(bad)


class _Bucket:  # the two methods of dist.GradBucket the compress hook uses
    def __init__(self, t, index=0):
        self.t, self.i = t, index

    def buffer(self):
        return self.t

    def index(self):
        return self.i


@pytest.mark.parametrize("feedback", [True, False])
def test_compress_hook_feeds_each_buckets_rounding_residual_into_its_next_step(tmp_path, feedback):
    """One rank (its all-reduce is the identity): step 1 gives round(g1); step 2 gives
    round(g2 + g1 - round(g1)) with error feedback, round(g2) without; buckets keep their own."""
    import redsock
    from redsock.bootstrap import FileStore
    from redsock.torch import HookState, compress_hook

    def rnd(t):
        return t.to(torch.bfloat16).float()

    g1, g2, other = (torch.randn(1000) * 3 for _ in range(3))
    with redsock.init(0, 1, FileStore(str(tmp_path)), servers=()) as comm:
        state, hook = HookState(comm), compress_hook("bf16", error_feedback=feedback)
        assert torch.equal(hook(state, _Bucket(g1.clone())).wait(), rnd(g1))
        assert torch.equal(hook(state, _Bucket(other.clone(), 1)).wait(), rnd(other))  # another bucket
        got = hook(state, _Bucket(g2.clone())).wait()
    assert torch.equal(got, rnd(g2 + (g1 - rnd(g1))) if feedback else rnd(g2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_tensors_ddp_and_fsdp2_match_gloo(world):
    check_ok(worker("cuda", world, timeout=300))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compress_hook_casts_cuda_buckets_on_the_device(tmp_path):
    """A CUDA bucket is rounded on the GPU and crosses to the host as 16 bits; the average
    comes back to the device in float32 (one rank; the wire's rounding is what is checked)."""
    import redsock
    from redsock.bootstrap import FileStore
    from redsock.torch import HookState, compress_hook

    g = torch.randn(1 << 20, device="cuda") * 3
    want = g.to(torch.bfloat16).float()
    with redsock.init(0, 1, FileStore(str(tmp_path)), servers=()) as comm:
        hook = compress_hook("bf16", error_feedback=True)
        got = hook(HookState(comm), _Bucket(g.clone())).wait()
    assert got.is_cuda and torch.equal(got, want)


@pytest.mark.parametrize("algo", ["server", "ring"])
def test_wire_accuracy_8_ranks_against_torch_fp16_compress_hook(reducers, algo):
    """8 ranks, 1M mixed-magnitude float32: redsock's fp16 wire errs less than torch's
    fp16_compress_hook on gloo on the same inputs; bf16 within its bound on every element."""
    outs = launch([str(WORKER), "wire_accuracy"], 8, timeout=240,
                  env={"REDSOCK_SERVERS": reducers, "TEST_WIRE_ALGO": algo, "TEST_TIMEOUT_S": "120"})
    check_ok(outs)
    print(next(line for line in outs[0][1].splitlines() if line.startswith("largest")))
