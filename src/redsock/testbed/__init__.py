"""Emulated cluster: network namespaces, veth links, tc shaping profiles, goodput probes.

Needs root (CAP_NET_ADMIN).  Addresses come from 198.18.0.0/15 only and all
traffic stays inside the namespaces.  See :mod:`redsock.testbed.cluster`.
"""

from .cluster import (
    PERFLOW_FRACTIONS,
    PROFILES,
    HostLink,
    NetnsTopology,
    PairTestbed,
    RankSlot,
    Testbed,
    TestbedStatus,
    cleanup_prefix,
    list_prefix_netns,
    load,
    place_ranks,
)
from .measure import FlowRate, GoodputResult, measure_flows, measure_tcp_goodput
from .netns import (
    TestbedError,
    format_rate,
    parse_rate,
    path_class,
    port_for_class,
    shape_per_flow,
    shape_uniform,
)

__all__ = [
    "PERFLOW_FRACTIONS", "PROFILES", "FlowRate", "GoodputResult", "HostLink", "NetnsTopology",
    "PairTestbed", "RankSlot", "Testbed", "TestbedError", "TestbedStatus", "cleanup_prefix", "format_rate",
    "list_prefix_netns", "load", "measure_flows", "measure_tcp_goodput", "parse_rate",
    "path_class", "place_ranks", "port_for_class", "shape_per_flow", "shape_uniform",
]
