"""Where one rank's step time went, in seven parts that add up to its `step_time_s` (the MFU
split, docs/observability.md "The MFU split"):

    clock = StepClock(device)          # one per rank (the trainer's Timeline holds it)
    clock.begin()                      # the step starts: its time is the host's until a part says
    with clock.part("compute", comm="dp"):   # the rank's own work; a wait inside it is a dp wait
        with clock.wait():             # blocked on a collective (hooked: `install`)
            ...
    seconds = clock.end()              # {"compute", "host", "data", "tp", "dp", "pp"}: seconds
    split = split_step(seconds, step_time_s, window_s=..., ideal=...)   # the seven parts

Every second of the step belongs to the innermost part open at that moment (the step itself is
"host"), so a rank blocked on a peer is never computing: a rank stopped from outside shows its
own compute grow, and its peers, waiting for it inside collectives and receives, do not.

The waits are found where torch blocks, hooked once per process (`install`): a tensor-parallel
collective where its result is waited (DTensor's collectives go through
`torch.distributed._functional_collectives`, waited by `AsyncCollectiveTensor`), the data
parallel gradient reduction in FSDP2's parameter groups (`fully_shard` and `replicate` alike)
and the pipeline schedules' waits on sends and receives (`schedules._wait_batch_p2p`). The step's
own collectives (clipping's norm, the loss, the commit vote) are timed where the trainer calls
them. On CPU a wait is timed on the host (perf_counter); on CUDA a host timer sees only the
launch, so a wait is a pair of CUDA events on the current stream, which the stream passes only
once the collective it waits for is done, read at the end of the step (after the step's own
host syncs: the loss read and the commit vote, no sync added). There the host timers see
launches, and the host blocked in the step's syncs (`StepClock.sync`) is the device computing:
compute is that, less the device's waits (which happened inside it); host is the host's own."""

from __future__ import annotations

import importlib
import logging
import threading
import time

import torch

from rayhybrid.config.topology import bubble_fraction
from rayhybrid.trainer.results import SPLIT_PARTS

log = logging.getLogger(__name__)

COMM = ("tp", "dp", "pp")
"""The communication waits, by the mesh dimension whose peers the rank waits for."""

ACTIVE: StepClock | None = None
"""The clock of the step running in this process (None between steps): the hooks charge to it."""


class _Part:
    """One open part of the step (a reusable context manager: the clock keeps the nesting)."""

    __slots__ = ("clock", "comm", "name")

    def __init__(self, clock: StepClock, name: str | None, comm: str | None) -> None:
        self.clock, self.name, self.comm = clock, name, comm

    def __enter__(self) -> None:
        self.clock.enter(self.name, self.comm)

    def __exit__(self, *exc) -> None:
        self.clock.leave()


class StepClock:
    """One rank's step time, charged to the innermost open part: "host" (the step itself, and
    anything no part claims), "compute", "data", or a wait ("tp", "dp", "pp"). A part names the
    wait its hooked waits count as (`comm`); a wait inside a compute part of the forward and
    backward is a tp one unless said otherwise."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.stack: list[tuple[str, str, object]] = []  # (part, its waits' kind, CUDA start event)
        self.pairs: list[tuple[str, object, object]] = []  # CUDA: (wait kind, start, end)
        self.mark = time.perf_counter()
        self.thread = threading.get_ident()
        self.active = False  # between `begin` and `end`: parts outside a step (evaluation) count nothing
        self._parts: dict[tuple, _Part] = {}

    def begin(self) -> None:
        """The step starts: its time is the host's until a part opens; the hooks charge here."""
        global ACTIVE
        self.seconds = dict.fromkeys(("compute", "host", "data", *COMM), 0.0)
        self.stack = [("host", "tp", None)]
        self.pairs = []
        self.thread = threading.get_ident()
        self.mark = time.perf_counter()
        self.active = True
        ACTIVE = self

    def part(self, name: str, comm: str | None = None) -> _Part:
        """A context manager: the time inside is `name`'s ("compute", "data", "host"), the hooked
        waits inside are `comm` ones (default: the enclosing part's)."""
        key = (name, comm)
        if (found := self._parts.get(key)) is None:
            found = self._parts[key] = _Part(self, name, comm)
        return found

    def wait(self, kind: str | None = None) -> _Part:
        """A context manager: blocked on a collective of `kind` (default: the enclosing part's)."""
        return self.part(None, kind)

    def sync(self) -> _Part:
        """A context manager: the host blocked in one of the step's own device syncs (the loss
        read). On CUDA that is the device's forward and backward finishing, so compute (the
        device's waits are taken out of it at `end`); on CPU nothing is pending: the host's."""
        return self.part("compute" if self.cuda else "host")

    def enter(self, name: str | None, comm: str | None) -> None:
        if not self.active:
            return
        now = time.perf_counter()
        top = self.stack[-1]
        self.seconds[top[0]] += now - self.mark
        self.mark = now
        comm = comm or top[1]
        start = None
        if name is None:  # a wait
            name = comm
            if self.cuda and top[0] not in COMM:  # a wait inside a wait is the outer one's time
                start = torch.cuda.Event(enable_timing=True)
                start.record()
        self.stack.append((name, comm, start))

    def leave(self) -> None:
        if not self.active:
            return
        now = time.perf_counter()
        name, _, start = self.stack.pop()
        self.seconds[name] += now - self.mark
        self.mark = now
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((name, start, end))

    def end(self) -> dict[str, float]:
        """The step ends: seconds by part. On CUDA the waits are the device's (events), read now
        that the step's own host syncs have passed them."""
        global ACTIVE
        if ACTIVE is self:
            ACTIVE = None
        if not self.active:  # no step began (an evaluation before the first), or it ended already
            return dict(self.seconds)
        self.active = False
        now = time.perf_counter()
        self.seconds[self.stack[-1][0]] += now - self.mark
        self.mark = now
        seconds = dict(self.seconds)
        if self.cuda:  # the host's readings of waits are launches (and a wait's own sync): compute's
            blocked = sum(seconds[kind] for kind in COMM)
            for kind in COMM:
                seconds[kind] = 0.0
            for kind, start, end in self.pairs:
                end.synchronize()  # recorded before the step's last host sync: already passed
                seconds[kind] += start.elapsed_time(end) / 1e3
            self.pairs = []
            # The device's waits happened inside the syncs the host counted as compute: out of it.
            device_waits = sum(seconds[kind] for kind in COMM)
            seconds["compute"] = max(0.0, seconds["compute"] + blocked - device_waits)
        return seconds


def ideal_bubble(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The schedule's idle share with no communication at all, for p pipeline ranks holding v
    stages each and m micro-batches: the planner's `bubble_fraction` (config/topology.py), e.g.
    (p-1)/(v*m + p-1) for 1F1B and interleaved 1F1B, a third of it for zero bubble (ZB-H1),
    0 for ZB-V with m >= 2p-1; 0 without a pipeline."""
    return bubble_fraction(schedule, pp, microbatches, stages_per_rank)[0]


def split_step(seconds: dict[str, float], step_time_s: float, *, window_s: float, ideal: float) -> dict[str, float]:
    """A step's clock readings -> the seven parts (`SPLIT_PARTS`), adding up to `step_time_s`.

    The pipeline's waits on receives are its idle time; of them, the bubble is at most the
    schedule's ideal idle share of its window (`ideal` x `window_s`, see `ideal_bubble`) and
    the rest is pp communication. Compute is what remains of the step once the waits, the data
    and the host are taken out; where the readings exceed the step (CUDA's device waits against
    a host step time), they are scaled down to fit and compute is 0."""
    pp_idle = seconds.get("pp", 0.0)
    bubble = min(pp_idle, max(0.0, ideal * window_s))
    parts = {  # SPLIT_PARTS, compute_s first below
        "data_wait_s": seconds.get("data", 0.0),
        "bubble_s": bubble,
        "comm_dp_s": seconds.get("dp", 0.0),
        "comm_tp_s": seconds.get("tp", 0.0),
        "comm_pp_s": pp_idle - bubble,
        "host_s": seconds.get("host", 0.0),
    }
    others = sum(parts.values())
    if others > step_time_s > 0:
        scale = step_time_s / others
        parts = {name: s * scale for name, s in parts.items()}
        others = step_time_s
    split = {"compute_s": max(0.0, step_time_s - others), **parts}
    return {name: split[name] for name in SPLIT_PARTS}


def _waited(fn, kind: str | None):
    """`fn`, its time charged to the running step's clock as a wait of `kind` (None: the
    enclosing part's); untouched outside a step, on another thread (CPU: a background upload)
    and while torch.compile traces."""

    def waited(*args, **kwargs):
        clock = ACTIVE
        if clock is None or torch.compiler.is_compiling() or (not clock.cuda and threading.get_ident() != clock.thread):
            return fn(*args, **kwargs)
        with clock.wait(kind):
            return fn(*args, **kwargs)

    waited.__wrapped__ = fn
    return waited


HOOKS = (
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor", ("trigger_wait", "wait"), None, "tp"),
    (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "FSDPParamGroup",
        ("unshard", "wait_for_unshard", "post_backward", "finalize_backward"),
        "dp",
        "dp",
    ),
    ("torch.distributed.pipelining.schedules", "", ("_wait_batch_p2p",), "pp", "pp"),
)
"""Where torch blocks: (module, class in it or "" for the module, functions, the wait's kind
(None: the enclosing part's), what the waits are, for the warning when torch moved them)."""

_INSTALLED = False


def install(hooks=HOOKS) -> None:
    """Hook the waits torch blocks in (once per process; see the module's docstring). A place
    torch moved is skipped with one warning: its waits then count as compute."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    for module, owner, names, kind, what in hooks:
        try:
            target = importlib.import_module(module)
            target = getattr(target, owner) if owner else target
            found = [(name, getattr(target, name)) for name in names]
        except (ImportError, AttributeError) as err:
            log.warning("the MFU split does not see the %s waits, which count as compute: %s", what, err)
            continue
        for name, fn in found:
            setattr(target, name, _waited(fn, kind))
