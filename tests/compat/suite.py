"""torch's own distributed test suite (``DistributedTest._DistTestBase``) set up for one backend.

What upstream's ``test/distributed/test_distributed_spawn.py`` does for gloo (it is not in
the wheel): ``BACKEND``, ``WORLD_SIZE``, ``INIT_METHOD=file://...``, ``TEMP_DIR`` with a
``barrier`` file, and a ``TestDistBackend`` subclass whose ``setUp`` starts the ranks.  For
a backend registered from Python (redsock) it also:

* adds it to every feature set of ``DistTestCases`` that lists gloo (``ddp``, ``subgroup``,
  ``gpu``, ``cuda``: CPU tests behind a GPU feature still skip for want of GPUs), to
  ``plugin`` (a backend registered from Python), and to the suite's profiling allow-lists
  that list gloo;
* with the gate ``gloo``: evaluates the suite's backend-name gates (``BACKEND == "gloo"``,
  ``require_backend_is_available({"gloo"})``, ...) as for gloo — the module is imported
  with ``BACKEND=gloo`` — and then runs every test on the real backend: the module's
  ``BACKEND`` global, which ``init_process_group`` and the test bodies read, becomes the
  backend's name, a string that also compares equal to "gloo" (the bodies branch on it).

``suite_env.prepare_environment`` sets the variables; importing this module afterwards builds
``TestDistBackendWithSpawn`` from them, in the parent and in the forkserver the ranks are
forked from (which inherits the parent's environment).
"""

from __future__ import annotations

import os

from suite_env import GATE as _GATE
from suite_env import START as _START


def _forkserver():
    """Ranks forked from one server process that imported this module (so torch and the
    11,000-line suite) once: spawn imports them again in every rank of every test, about 10 s
    per test on 2 cores.  Each rank still starts from a process that ran no test."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # (preloading "__main__" is broken before Python 3.12)
    return ctx


def _forkserver_process(target, name, args, kwargs):
    """A forkserver Process that first takes the parent's environment as it is now (the
    suite sets TEMP_DIR and INIT_METHOD per test; spawn would inherit them)."""
    return _forkserver().Process(target=_in_environment, name=name, args=(dict(os.environ), target, *args),
                                 kwargs=kwargs)


def _in_environment(environ, target, *args, **kwargs):
    os.environ.clear()
    os.environ.update(environ)
    # The suite reads INIT_METHOD into a global at import (the forkserver's import, with the
    # first test's value); a spawned rank would read this test's.
    from torch.testing._internal.distributed import distributed_test

    distributed_test.INIT_METHOD = os.environ["INIT_METHOD"]
    return target(*args, **kwargs)


def _load_suite_module():
    """Import ``distributed_test`` with the feature sets and the name gate set up (see above)."""
    import torch.distributed as dist
    from torch.testing._internal import common_distributed

    backend = os.environ["BACKEND"]
    if backend not in ("gloo", "nccl", "mpi", "ucc"):
        import redsock.torch  # noqa: F401  (registers the backend; autoload normally does)

        features = common_distributed.DistTestCases.backend_feature
        for name, members in features.items():
            if "gloo" in members:
                members.add(backend)
        features["plugin"].add(backend)
    gate = os.environ.get(_GATE)
    if gate:
        os.environ["BACKEND"] = gate  # the decorators read it while the module is imported
    try:
        from torch.testing._internal.distributed import distributed_test as suite
    finally:
        os.environ["BACKEND"] = backend
    # What init_process_group and the test bodies use; with a gate, a name that also
    # equals the gate's, so the bodies' own comparisons ("if BACKEND == 'gloo'") hold too.
    suite.BACKEND = _Alias(backend, gate) if gate else backend
    for allow in (suite.PROFILING_SUPPORTED_BACKENDS, suite.CUDA_PROFILING_SUPPORTED_BACKENDS,
                  suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        if dist.Backend.GLOO in allow and backend not in allow:
            allow.append(backend)
    return suite


class _Alias(str):
    """A backend's name that also compares equal to ``alias`` (hashes as the name itself)."""

    def __new__(cls, name: str, alias: str) -> "_Alias":
        self = super().__new__(cls, name)
        self.alias = alias
        return self

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) is True or other == self.alias

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _make_test_class():
    import torch

    suite = _load_suite_module()

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if os.environ.get(_START) == "spawn":
                self._spawn_processes()
            else:
                self._start_processes(_forkserver_process)
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        def tearDown(self):
            super().tearDown()
            try:  # the test's store file: the suite's TestDistBackend leaves it (delete=False)
                os.remove(self.file_name)
            except OSError:
                pass

    # spawn pickles the class by name: it must be this module's global of that name
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    TestDistBackendWithSpawn.__module__ = __name__
    return TestDistBackendWithSpawn


TestDistBackendWithSpawn = _make_test_class()


