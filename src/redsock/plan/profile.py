"""The model's constants (a *profile*): what one message, one byte on a link, one byte summed
by a reducer and one byte copied inside a host cost.  ``redsock calibrate`` measures them
and writes a JSON file; ``redsock plan --profile FILE`` reads it.

Without a profile, :data:`DEFAULT` is used: the figures measured on the project's 2-core lab,
per-message latencies from its emulated cluster (docs/results.md, section 3, N=2) and the
rest from ``redsock calibrate`` on that machine.  Per-message costs
there are those of Python processes sharing 2 cores, so they are pessimistic for real hosts;
per-byte link costs only depend on the NIC rate given to ``plan``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..bench.bounds import GOODPUT_FACTOR
from ..config import SMALLEST_PIECE_BYTES, KiB
from ..errors import ConfigError

__all__ = ["DEFAULT", "Profile", "check_piece_bytes", "load_profile"]

PROFILE_VERSION = 1


@dataclass(frozen=True)
class Profile:
    """Constants of :mod:`redsock.plan.model`; seconds and bytes per second throughout."""

    #: Payload bytes per line-rate byte of a TCP link (Ethernet/IP/TCP headers; the testbed's
    #: tc counts them too, and a 1 Gbit/s link carried 0.956 Gbit/s of payload).
    goodput_factor: float = GOODPUT_FACTOR
    #: One step of gloo's ring (send a segment, receive one, small messages): half of its
    #: 2-rank 8-byte all-reduce (2 steps).  Lab: 416 us / 2.
    gloo_step_s: float = 208e-6
    #: One point-to-point step of redsock (ring step, recursive-doubling round): the 2-rank
    #: 8-byte recursive-doubling all-reduce (1 round).  Lab: 55 us.
    redsock_step_s: float = 55e-6
    #: One worker <-> reducer hop (a round is two).  Lab: 2-rank 8-byte all-reduce through
    #: reducers 526 us / 2.
    reducer_hop_s: float = 263e-6
    #: CPU seconds a reducer spends per byte of contributions it receives (receive, sum, send
    #: back): its per-byte cost.  Lab (``calibrate``, loopback): 0.42 s for 320 MiB.
    reducer_cpu_s_per_byte: float = 1.25e-9
    #: Bytes per second one rank adds into its accumulator (redsock's float32 sum, one core).
    #: Lab (``calibrate``): 17.2 GB/s on 16 MiB arrays.
    reduce_Bps: float = 17e9
    #: Bytes per second one rank copies (memcpy) into or out of shared memory inside a host;
    #: a transfer through shared memory is two copies (the sender's in, the receiver's out).
    #: Lab (``calibrate``): 14.3 GB/s on 16 MiB arrays.
    intra_Bps: float = 14e9
    #: Bytes per second one TCP flow carries over loopback inside a host (gloo's in-host ring
    #: edges).  Lab (``calibrate``, one plain socket, 64 MiB messages): 19.8 Gbit/s.
    loopback_Bps: float = 2.47e9
    #: Largest piece sent to a reducer (REDSOCK_PIECE_BYTES): a reducer forwards a piece once it
    #: has all of it, so the last pieces still cross the NICs after the upload (model.py: drain).
    piece_bytes: int = 256 * 1024
    #: Where the figures come from.
    source: str = "built-in defaults (the 2-core lab)"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "source":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"profile: {f.name} must be a positive number, got {v!r}")
        if self.goodput_factor > 1:
            raise ConfigError(f"profile: goodput_factor must be in (0, 1], got {self.goodput_factor}")

    def to_json(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def from_json(cls, obj: Any, origin: str = "profile") -> "Profile":
        if not isinstance(obj, dict):
            raise ConfigError(f"{origin}: expected a JSON object")
        version = obj.get("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise ConfigError(f"{origin}: profile version {version!r}, this redsock reads {PROFILE_VERSION}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known - {"version", "measured"})
        if unknown:
            raise ConfigError(f"{origin}: unknown field(s) {', '.join(unknown)}")
        # A partial profile overrides the defaults field by field.
        profile = replace(DEFAULT, **{k: v for k, v in obj.items() if k in known})
        check_piece_bytes(profile.piece_bytes, origin)
        return profile


DEFAULT = Profile()


def check_piece_bytes(value: int, origin: str) -> None:
    """A piece cap a user gives the planner: at least REDSOCK_PIECE_BYTES' floor, as no worker
    cuts smaller pieces (and the reducer search would try a count per smallest piece)."""
    if value < SMALLEST_PIECE_BYTES:
        raise ConfigError(f"{origin}: piece_bytes must be >= {SMALLEST_PIECE_BYTES} "
                          f"({SMALLEST_PIECE_BYTES // KiB} KiB), got {value}")


def load_profile(path: str | Path | None) -> Profile:
    """The profile in ``path`` (JSON written by ``redsock calibrate``), or :data:`DEFAULT`."""
    if path is None:
        return DEFAULT
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read profile {path}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"profile {path} is not JSON: {e}") from None
    return Profile.from_json(obj, str(path))
