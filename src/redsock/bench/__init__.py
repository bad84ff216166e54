"""Benchmarks (``redsock bench``): runners that measure, and :mod:`.report` that prints.

Every runner produces :class:`redsock.bench.report.Row` objects, one per message
size and implementation; :mod:`redsock.bench.report` turns them into the
nccl-tests table, a side-by-side comparison against gloo measured in the same
run, JSON Lines (``--json``) and a plot.
"""
