"""Ray's own text during a run: in the run's log file, not on the terminal, where the user
sees rayhybrid's one line per event (`RayText`, opened and closed by the run log,
rayhybrid/driver/runlog.py)."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

from rayhybrid.storage.store import one_line

log = logging.getLogger("rayhybrid")


class RayText:
    """Ray's own text during a run, in the run's log file instead of on the terminal, where
    the user sees rayhybrid's one line per event. Ray prints, on the driver:

    - its error messages ("(raylet) A worker died or was killed while executing a task by an
      unexpected system error..."), which its error-listener thread passes to
      `ray._private.worker.print_to_stdstream`;
    - what the workers write (log_to_driver), which its log thread passes to the same
      function through the "ray_print_logs" handler of its stdout/stderr dispatcher, and the
      autoscaler's events ("(autoscaler +1m) ...");
    - its driver-side log records (the `ray` logger: "Unhandled error ... RayActorError").

    While a run is open, Ray's error messages, the autoscaler's events, the workers' stderr
    (their log records, warnings and tracebacks; rayhybrid's worker lines) and the `ray`
    logger's records go to the run's log file: Hydra's `<run dir>/__main__.log` for a
    command-line run, `<run dir>/tune.log` for a tune (rayhybrid/tune/run.py), else
    `<run dir>/ray.log` (made at the first line); `printed` adds what the process prints. The workers' stdout (a
    user's print) stays on the terminal, deduplicated by Ray as before. Ray has no hook for the
    error messages but the module function its listener looks up at each message, so that
    function is swapped (`_route`) while any run is open; the workers' lines come through
    Ray's dispatcher handler, and the records through the `ray` logger's handlers. When the
    last run closes, Ray prints as before (a notebook or a test reuses its Ray). With a
    `ray://` address (Ray Client) the text comes through the client and still prints.

    All this uses Ray's private modules (`_ray_internals`). A Ray where one of them moved
    routes nothing: the run goes on with Ray's text on the terminal, as Ray prints it, after
    one warning line."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    open_runs: ClassVar[list[RayText]] = []
    """The runs whose Ray text is routed, newest last: the newest gets it."""
    saved: ClassVar[tuple | None] = None
    """While any run is open: Ray's `print_to_stdstream` and the `ray` logger's handlers."""

    def __init__(self, run_dir: Path) -> None:
        self.ray = _ray_internals()
        self.closed = self.ray is None  # nothing to route: Ray prints as it does
        self.handler = None
        if self.closed:
            return
        self.handler, self.own_handler = _run_log_handler(run_dir)
        self.ray_was_up = self.ray.worker.global_worker.connected
        with RayText.lock:
            if not RayText.open_runs:
                _install()
            RayText.open_runs.append(self)

    def write(self, data: dict, lines: list[str]) -> None:
        """One batch of lines from one source, as Ray would print it, to the log file."""
        pid, name = data.get("pid"), data.get("actor_name") or data.get("task_name")
        source = str(pid) if pid in ("raylet", "autoscaler") else f"{name + ' ' if name else ''}pid={pid}"
        if data.get("ip") and data.get("ip") != data.get("localhost"):
            source += f", ip={data['ip']}"
        if pid == "autoscaler":  # the monitor's whole log comes; Ray prints only its events
            lines = self.ray.worker.filter_autoscaler_events(lines)
        level = logging.WARNING if pid == "raylet" else logging.INFO
        for line in lines:
            text = line.split(self.ray.info_prefix)[-1]
            self.handler.handle(logging.LogRecord("ray", level, __file__, 0, "(%s) %s", (source, text), None))

    @contextlib.contextmanager
    def printed(self):
        """Meanwhile, what this process prints (to sys.stdout and sys.stderr: a library's
        banners and tables, Ray Tune's progress output, the workers' lines Ray prints) goes to
        the run's log file, line by line, as `stdout` and `stderr` records. rayhybrid's own
        lines still show: its logger's handlers hold the stream they were made with. Nothing is
        redirected when Ray's text is not routed (a Ray without the private parts)."""
        if self.closed or self.handler is None:
            yield
            return
        with (
            contextlib.redirect_stdout(_LinesToLog(self.handler, "stdout")) as out,
            contextlib.redirect_stderr(_LinesToLog(self.handler, "stderr")) as err,
        ):
            try:
                yield
            finally:
                out.flush_line()
                err.flush_line()

    def close(self) -> None:
        """The run is over: Ray prints to the terminal again (once no other run is open). When
        the run started its own Ray, which the driver shuts down right after, that happens once
        Ray has shut down, so its last lines (a worker line late through Ray's log monitor, a
        message about the workers just stopped) still go to the file. Later calls do nothing."""
        if self.closed:
            return
        self.closed = True
        node = self.ray.worker._global_node
        if not self.ray_was_up and node is not None and node.is_head():
            threading.Thread(target=self._end_after, args=(node,), name="rayhybrid-ray-text", daemon=True).start()
        else:
            self._end()

    def _end_after(self, node, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ray.worker._global_node is node and time.monotonic() < deadline:
            time.sleep(0.05)
        self._end()

    def _end(self) -> None:
        with RayText.lock:
            if self in RayText.open_runs:
                RayText.open_runs.remove(self)
            if not RayText.open_runs and RayText.saved is not None:
                _uninstall()
        if self.own_handler:
            self.handler.close()


def _route(data: dict, ignore_prefix: bool = False) -> None:
    """Ray's `print_to_stdstream` while a run is open: one batch of lines from one source, to
    the newest open run's log file, or as Ray prints it (the workers' stdout, tqdm_ray's bars,
    anything once no run is open)."""
    ray = _ray_internals()
    with RayText.lock:
        run = RayText.open_runs[-1] if RayText.open_runs else None
        printer = RayText.saved[0] if RayText.saved is not None else ray.print_to_stdstream
    lines = data.get("lines", [])
    magic = getattr(ray.worker, "RAY_TQDM_MAGIC", None)
    from_ray = data.get("pid") in ("raylet", "autoscaler")
    if run is not None and (from_ray or data.get("is_err")) and not (magic and any(magic in x for x in lines)):
        run.write(data, lines)
    else:
        printer(data, ignore_prefix)


@functools.cache
def _ray_internals() -> SimpleNamespace | None:
    """Ray's private parts that RayText uses, looked up when the first run opens: None, after
    one warning line, in a Ray where one has moved (tests/test_private_apis.py lists them)."""
    try:
        from ray._private import ray_constants, worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        for name in ("_global_node", "filter_autoscaler_events"):
            getattr(worker, name)
        worker.global_worker.connected  # noqa: B018 - looked up: a moved one is an AttributeError here
        for name in ("handlers", "add_handler", "remove_handler"):
            getattr(dispatcher, name)
        return SimpleNamespace(
            worker=worker,
            print_to_stdstream=worker.print_to_stdstream,  # Ray's own, before any swap
            info_prefix=ray_constants.LOG_PREFIX_INFO_MESSAGE,
            dispatcher=dispatcher,
        )
    except (ImportError, AttributeError) as err:
        log.warning(
            "Ray's own text stays on the terminal, as Ray prints it: this Ray lacks what rayhybrid routes it with "
            "(%s); rayhybrid is tested with ray==2.60.*",
            one_line(err),
        )
        return None


def _install() -> None:
    """Ray's text to `_route` (under RayText.lock, when the first run opens)."""
    ray_worker = _ray_internals().worker
    ray_logger = logging.getLogger("ray")
    RayText.saved = (ray_worker.print_to_stdstream, list(ray_logger.handlers))
    ray_worker.print_to_stdstream = _route  # a ray.init from now on binds it for the workers' lines
    _swap_dispatcher(RayText.saved[0], _route)  # a driver connected already
    for handler in RayText.saved[1]:
        ray_logger.removeHandler(handler)
    ray_logger.addHandler(_FORWARD)


def _uninstall() -> None:
    """Ray prints as before (under RayText.lock, when the last run closes)."""
    ray_worker = _ray_internals().worker
    printer, handlers = RayText.saved
    RayText.saved = None
    if ray_worker.print_to_stdstream is _route:
        ray_worker.print_to_stdstream = printer
    _swap_dispatcher(_route, printer)
    ray_logger = logging.getLogger("ray")
    ray_logger.removeHandler(_FORWARD)
    for handler in handlers:
        ray_logger.addHandler(handler)


def _swap_dispatcher(old, new) -> None:
    """Ray's handler of the workers' lines (there while a driver with log_to_driver is
    connected) calls `new` where it called `old`."""
    dispatcher = _ray_internals().dispatcher
    for name, handler in list(dispatcher.handlers):
        if name == "ray_print_logs" and isinstance(handler, functools.partial) and handler.func is old:
            dispatcher.remove_handler(name)
            dispatcher.add_handler(name, functools.partial(new, *handler.args, **handler.keywords))


class _LinesToLog(io.TextIOBase):
    """A text stream whose lines become records of `name` in the run's log file (`printed`)."""

    def __init__(self, handler: logging.Handler, name: str) -> None:
        super().__init__()
        self.handler, self.name = handler, name
        self.lock = threading.Lock()  # Ray's log thread prints too
        self.part = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:
            *lines, self.part = (self.part + text).split("\n")
        for line in lines:
            self._record(line)
        return len(text)

    def flush_line(self) -> None:
        """The last line, when it had no newline."""
        with self.lock:
            line, self.part = self.part, ""
        self._record(line)

    def _record(self, line: str) -> None:
        if line.strip():
            self.handler.handle(logging.LogRecord(self.name, logging.INFO, __file__, 0, "%s", (line.rstrip(),), None))


class _ToRunLog(logging.Handler):
    """The `ray` logger's handler while a run is open: its records to the newest open run's log
    file (ray.init sets the formatter of that logger's handlers: this one's, not the file's)."""

    def emit(self, record: logging.LogRecord) -> None:
        with RayText.lock:
            run = RayText.open_runs[-1] if RayText.open_runs else None
        if run is not None:
            run.handler.handle(record)


_FORWARD = _ToRunLog()


def _run_log_handler(run_dir: Path) -> tuple[logging.Handler, bool]:
    """The handler of the run's log file: Hydra's (a FileHandler writing into the run
    directory), else a new one on `<run dir>/ray.log`; and whether it is new (ours to close)."""
    for logger in (logging.getLogger(), logging.getLogger("rayhybrid")):
        for handler in logger.handlers:
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir:
                return handler, False
    handler = logging.FileHandler(run_dir / "ray.log", delay=True)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    return handler, True
