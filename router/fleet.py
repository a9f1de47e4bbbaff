"""`infire-jax fleet CONFIG.yaml`: a whole local fleet (workers and the router in front) from one YAML file.

Every worker is an `infire-jax serve --role ROLE` subprocess; once each has printed its ready line
the router starts with the workers' URLs (`--prefill`/`--decode` for those roles, `--worker` for
`both`). The fleet prints `fleet ready: URL (router)` and one line per worker, then runs until
SIGINT or SIGTERM and stops the router, then the workers (SIGTERM, SIGKILL after a timeout). A
worker that dies meanwhile is reported and the fleet goes on (the router routes around it); a
router that dies ends the fleet. `Fleet` does the same from Python, for the benchmarks and tests.

The YAML file (unknown keys are errors; every key but `workers` is optional):

    model: null                  # --model of every worker (default: the serve default)
    worker_args: ["--dtype", "float32", "--max-num-seqs", "32"]   # serve flags of every worker
    router:
      host: 127.0.0.1            # the router's address (overridden by fleet --host)
      port: 8000                 # 0: any free port (overridden by fleet --port)
      args: ["--policy", "cache_aware"]   # more router flags
    workers:                     # all `both`, or at least one `prefill` and one `decode`
      - name: prefill0           # unique; letters, digits, `.`, `_`, `-` (default: ROLE + index)
        role: prefill            # prefill | decode | both
        host: 127.0.0.1          # address the worker listens on (default 127.0.0.1)
        port: 0                  # 0: any free port (the worker's ready line names it)
        model: null              # this worker's --model, instead of the top-level one
        cpus: [0]                # pin the process to these CPU cores (sched_setaffinity)
        gpus: [0]                # CUDA_VISIBLE_DEVICES of the worker
        env: {XLA_PYTHON_CLIENT_MEM_FRACTION: 0.45}   # more environment variables of the worker
        args: ["--max-num-batched-tokens", "512"]   # more serve flags of this worker
      - name: decode0
        role: decode
        cpus: [1]

A worker's command line is `python -m infire_jax serve --host H --port P --role R [--model M]
worker_args... args...`; the fleet owns --host, --port, --role and --model (use the keys), and the
router's --host, --port, --prefill, --decode and --worker. Each process's stderr (and any stdout
besides the ready line) goes to NAME.log in the log directory (`--log-dir`, default a new temporary
directory, kept afterwards).

CPU pinning: `cpus` sets the child's affinity mask before it runs Python (preexec_fn), and every
thread it starts inherits it. XLA's CPU client sizes its intra-op (Eigen) thread pool from the
affinity mask, not from the machine's core count: measured with jax 0.10 on a 2-core machine, a
process pinned to one core runs 1 `tf_XLAEigen` thread (2 unpinned), and its other pools shrink
too. OpenBLAS reads the mask as well, so OMP_NUM_THREADS and XLA flags are left alone.

Children run in their own sessions, so a Ctrl-C at the terminal reaches the fleet alone, which
stops the router before the workers (each gets one SIGTERM). They also get PR_SET_PDEATHSIG
(SIGTERM), so they stop if the process that started them dies without stopping them (SIGKILL, a
crash). Linux ties that to the starting *thread*: start a `Fleet` from a thread that outlives it
(the main thread, typically).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Sequence

from router.fleet_config import ROUTER_ROLE_FLAGS, FleetConfig, check_port, load_fleet_config

DEFAULT_READY_TIMEOUT_S = 900.0  # a worker's first start compiles every bucket
DEFAULT_STOP_TIMEOUT_S = 30.0


class FleetError(RuntimeError):
    """The fleet could not start (a process exited or was not ready in time)."""


# ---- processes -----------------------------------------------------------------------------------------

def _child_setup(cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """The preexec_fn of a child: its CPU affinity, and SIGTERM when its parent dies. It only makes
    system calls (prctl is looked up in the parent), nothing that could wait on a lock another
    thread of the parent held at fork."""
    prctl, parent = _PRCTL, os.getpid()

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the prctl
                os._exit(1)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return setup


_PR_SET_PDEATHSIG = 1
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


class Process:
    """One child (a worker or the router): its stderr goes to a log file; a thread reads its stdout
    for the `ready: URL` line and copies anything else to the log."""

    def __init__(self, name: str, role: str, argv: list[str], log_path: str, *,
                 env: dict[str, str] | None = None, cpus: tuple[int, ...] | None = None):
        self.name, self.role, self.argv, self.log_path, self.cpus = name, role, argv, log_path, cpus
        self.url: str | None = None
        self._ready = threading.Event()
        self._terminated = False
        self._log = open(log_path, "ab", buffering=0)
        self._log.write(f"$ {' '.join(argv)}\n".encode())
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
                                         env=env, preexec_fn=_child_setup(cpus), close_fds=True,
                                         start_new_session=True)
        except BaseException:
            self._log.close()
            raise
        self._reader: threading.Thread | None = None

    def start_reading(self) -> None:
        """Starts the stdout reader (Fleet starts the readers after it has started every worker)."""
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name=f"fleet-{self.name}-stdout", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                if self.url is None and line.startswith(b"ready: "):
                    self.url = line.split(b" ", 1)[1].strip().decode()
                    self._ready.set()
                else:
                    self._log.write(line)
        except (ValueError, OSError):  # the pipe or the log was closed by close()
            return

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode(errors="replace")
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"

    def signal(self, sig: int) -> None:
        """Sends `sig` to a live process; SIGTERM only once (a second one, while the server shuts
        down, would cut its clean-up short)."""
        if sig == signal.SIGTERM:
            if self._terminated:
                return
            self._terminated = True
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """After the process has exited: joins the reader, closes the pipe and the log."""
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


def wait_ready(procs: Sequence[Process], timeout: float, *, what: str = "fleet") -> None:
    """Waits until every process has printed its ready line; FleetError as soon as one exits (with
    the end of its log), or at the timeout."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start_reading()
    while True:
        pending = [p for p in procs if not p.ready]
        if not pending:
            return
        for p in pending:
            if p.returncode is not None:
                p.close()  # its reader has seen EOF: the log is complete
                if p.ready:
                    continue
                raise FleetError(f"{p.name} ({p.role}) exited with code {p.returncode} before it was ready; "
                                 f"the end of {p.log_path}:\n{p.log_tail()}")
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise FleetError(f"{what}: {names} not ready after {timeout:.0f}s; the end of "
                             f"{pending[0].log_path}:\n{pending[0].log_tail()}")
        pending[0]._ready.wait(0.1)


def stop_processes(procs: Sequence[Process], timeout: float) -> None:
    """SIGTERM to every live process at once, SIGKILL to those still alive after `timeout`."""
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.signal(signal.SIGKILL)
            p.proc.wait()
    for p in procs:
        p.close()


class Fleet:
    """Workers and a router on this machine, from a FleetConfig.

        with Fleet(load_fleet_config("router/configs/local-replicas.yaml"), router_port=0) as fleet:
            requests.post(fleet.router_url + "/v1/completions", ...)
            fleet.kill("both0")            # the router must route around it

    `start()` starts every worker at once, waits for all of them, then starts the router (unless
    `router=False`); if anything fails it stops what it started and raises FleetError. `stop()` stops
    the router first, then the workers; it is safe to call twice and from `__exit__`.
    """

    def __init__(self, config: FleetConfig, *, log_dir: str | None = None, router_host: str | None = None,
                 router_port: int | None = None, router: bool = True,
                 ready_timeout: float = DEFAULT_READY_TIMEOUT_S, stop_timeout: float = DEFAULT_STOP_TIMEOUT_S,
                 python: str = sys.executable, env: dict[str, str] | None = None):
        self.config = config
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="infire-fleet-")
        self.router_host = router_host or config.router.host
        self.router_port = config.router.port if router_port is None else router_port
        self.with_router = router
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.workers: dict[str, Process] = {}
        self.router: Process | None = None
        self._reported_dead: set[str] = set()

    # -- start and stop --

    def start(self) -> Fleet:
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            for w in self.config.workers:  # every Popen first: the stdout readers are threads
                env = {**self.env, **dict(w.env), "PYTHONUNBUFFERED": "1"}
                if w.gpus is not None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, w.gpus))
                self.workers[w.name] = Process(w.name, w.role, self.config.worker_command(w, self.python),
                                               os.path.join(self.log_dir, f"{w.name}.log"), env=env, cpus=w.cpus)
            wait_ready(list(self.workers.values()), self.ready_timeout, what="workers")
            if self.with_router:
                self.router = Process("router", "router", self.router_command(),
                                      os.path.join(self.log_dir, "router.log"),
                                      env={**self.env, "PYTHONUNBUFFERED": "1"})
                wait_ready([self.router], self.ready_timeout, what="router")
        except BaseException:
            self.stop()
            raise
        return self

    def router_command(self) -> list[str]:
        cmd = [self.python, "-m", "infire_jax", "router", "--host", self.router_host, "--port", str(self.router_port)]
        for w in self.config.workers:
            cmd += [ROUTER_ROLE_FLAGS[w.role], self.workers[w.name].url]
        return cmd + list(self.config.router.args)

    def stop(self) -> None:
        if self.router is not None:
            stop_processes([self.router], self.stop_timeout)
        stop_processes(list(self.workers.values()), self.stop_timeout)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- state --

    @property
    def router_url(self) -> str | None:
        return self.router.url if self.router else None

    @property
    def urls(self) -> dict[str, str | None]:
        """Worker name -> its URL."""
        return {name: p.url for name, p in self.workers.items()}

    def urls_by_role(self, role: str) -> list[str]:
        return [p.url for p in self.workers.values() if p.role == role and p.url]

    def pid(self, name: str) -> int:
        return self._worker(name).pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signals one worker (SIGKILL by default) and, for a SIGKILL, waits until it is gone."""
        p = self._worker(name)
        p.signal(sig)
        if sig == signal.SIGKILL:
            p.proc.wait()

    def newly_dead(self) -> list[Process]:
        """Workers that have exited since the last call."""
        dead = [p for p in self.workers.values() if not p.alive and p.name not in self._reported_dead]
        self._reported_dead.update(p.name for p in dead)
        return dead

    def describe(self) -> list[str]:
        """The `fleet ready` line and one line per worker: name, role, URL, pid (aligned)."""
        lines = [f"fleet ready: {self.router_url} (router) pid {self.router.pid}" if self.router
                 else "fleet ready: (no router)"]
        rows = [(p.name, p.role, p.url or "-", f"pid {p.pid}") for p in self.workers.values()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
        return lines

    def _worker(self, name: str) -> Process:
        try:
            return self.workers[name]
        except KeyError:
            raise KeyError(f"no worker named {name!r} (workers: {', '.join(self.workers)})") from None


# ---- command line ----------------------------------------------------------------------------------------

def add_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="fleet YAML file (see router/configs/ for examples)")
    p.add_argument("--host", default=None, help="the router's address (default: router.host of the config)")
    p.add_argument("--port", type=int, default=None,
                   help="the router's port, 0 for any free port (default: router.port of the config)")
    p.add_argument("--log-dir", default=None,
                   help="directory of the per-process logs, NAME.log (default: a new temporary directory)")
    p.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT_S,
                   help="seconds each process may take to print its ready line (a first start compiles)")
    p.add_argument("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S,
                   help="seconds each process gets to exit after SIGTERM before SIGKILL")


class _Stop(BaseException):
    """Raised by the SIGINT/SIGTERM handler of run_fleet."""


def run_fleet(args: argparse.Namespace) -> int:
    try:
        config = load_fleet_config(args.config)
        if args.port is not None:
            check_port(args.port, "--port")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fleet = Fleet(config, log_dir=args.log_dir, router_host=args.host, router_port=args.port,
                  ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        print(f"fleet: {len(config.workers)} workers ({config.describe()}); logs in {fleet.log_dir}", flush=True)
        fleet.start()
        print("\n".join(fleet.describe()), flush=True)
        while True:
            time.sleep(0.5)
            for p in fleet.newly_dead():
                print(f"worker {p.name} ({p.role}, pid {p.pid}) exited with code {p.returncode}; "
                      f"see {p.log_path}", flush=True)
            if fleet.router is not None and not fleet.router.alive:
                print(f"error: the router exited with code {fleet.router.returncode}; the end of "
                      f"{fleet.router.log_path}:\n{fleet.router.log_tail()}", file=sys.stderr, flush=True)
                code = 1
                break
    except _Stop:
        pass
    except FleetError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        stopping = True
        fleet.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    print("fleet stopped", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infire-jax fleet", description=__doc__.split("\n\n", 1)[0])
    add_fleet_args(p)
    return run_fleet(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
