"""The embedded Kafka-protocol broker (noida-db) for laptops, tests and CI.

Started as its own process group (``start_new_session``) running the noida binary
directly, so ``down`` can stop the whole group: the ``noida-db`` launcher script would
leave the real broker running after a SIGTERM. State lives under ``data_dir``:
``broker.pid`` (JSON), ``broker.log`` and ``store/`` (the broker's own persisted data).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path

from streamrec.plumbing.bus.clients import BusUnavailable, make_admin

BINARY_ENV = "STREAMREC_NOIDA_BIN"


class BrokerError(RuntimeError):
    """The embedded broker could not be started, found or stopped."""


@dataclass(frozen=True)
class BrokerState:
    pid: int
    host: str
    port: int
    data_dir: str
    started_at: float

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


def find_binary() -> Path:
    """The noida broker binary: ``$STREAMREC_NOIDA_BIN`` or the one in the noida-db wheel."""
    override = os.environ.get(BINARY_ENV)
    if override:
        path = Path(override)
    else:
        try:
            path = Path(str(files("noida_db").joinpath("noida-db")))
        except ModuleNotFoundError:
            path = Path("<noida_db package not installed>")
    if not path.is_file():
        raise BrokerError(
            f"noida-db broker binary not found at {path}. Install it with `pip install noida-db==0.2.3` "
            f"(`make setup` does), or set {BINARY_ENV} to the binary's path."
        )
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it), for a child server to bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (SO_REUSEADDR ignores TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise BrokerError(f"cannot use {host}:{port}: {exc}") from None
    return False


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie child counts as gone, and is reaped)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to the signal check
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class EmbeddedBroker:
    """Start, stop and inspect one embedded broker bound to a loopback address."""

    def __init__(self, data_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 9092) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.port = port
        self.pid_file = self.data_dir / "broker.pid"
        self.log_file = self.data_dir / "broker.log"
        self.store_dir = self.data_dir / "store"

    # Above this, say so: the broker re-saves its whole store on every change, so its CPU
    # grows with the store (docs/kafka.md).
    LARGE_STORE_BYTES = 100 * 2**20

    def store_bytes(self) -> int:
        """Bytes the broker holds on disk (it holds the same in memory)."""
        return sum(p.stat().st_size for p in self.store_dir.glob("**/*") if p.is_file()) if self.store_dir.is_dir() else 0

    def status(self) -> BrokerState | None:
        """The running broker recorded in the PID file, or None (a stale file is removed)."""
        try:
            state = BrokerState(**json.loads(self.pid_file.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise BrokerError(f"PID file {self.pid_file} is unreadable ({exc}); remove it if no broker runs") from None
        if _alive(state.pid):
            return state
        self.pid_file.unlink(missing_ok=True)
        return None

    def up(self, timeout_s: float = 20.0) -> tuple[BrokerState, bool]:
        """Start the broker unless it already runs; wait until it answers Kafka requests.

        Returns the state and whether this call started it.
        """
        running = self.status()
        if running:
            return running, False
        if port_in_use(self.host, self.port):
            raise BrokerError(
                f"port {self.port} on {self.host} is already in use by another process; stop it, "
                f"or pick another port (--port / kafka.embedded_port), or use that broker with --bootstrap {self.host}:{self.port}"
            )
        binary = find_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [str(binary), "start", "--only", "kafka", "--kafka-port", str(self.port),
               "--host", self.host, "--data-dir", str(self.store_dir)]
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        state = BrokerState(proc.pid, self.host, self.port, str(self.data_dir), time.time())
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state)))
        tmp.replace(self.pid_file)
        try:
            self._wait_ready(proc, timeout_s)
        except BaseException:
            self._stop_pid(proc.pid, 5.0)
            self.pid_file.unlink(missing_ok=True)
            raise
        return state, True

    def _wait_ready(self, proc: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerError(f"broker exited with code {proc.returncode} during start-up; last log lines:\n{self.log_tail()}")
            if port_in_use(self.host, self.port):
                try:
                    admin = make_admin(f"{self.host}:{self.port}", timeout_s=max(1.0, deadline - time.monotonic()))
                    admin.list_topics()
                    admin.close()
                    return
                except BusUnavailable:
                    pass
            time.sleep(0.1)
        raise BrokerError(f"broker did not answer on {self.host}:{self.port} within {timeout_s:g}s; last log lines:\n{self.log_tail()}")

    def down(self, timeout_s: float = 15.0) -> bool:
        """Stop the broker's process group; returns False when none was running."""
        state = self.status()
        if state is None:
            return False
        self._stop_pid(state.pid, timeout_s)
        self.pid_file.unlink(missing_ok=True)
        deadline = time.monotonic() + timeout_s
        while port_in_use(state.host, state.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    @staticmethod
    def _stop_pid(pid: int, timeout_s: float) -> None:
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not _alive(pid):
                    return
                time.sleep(0.05)
        raise BrokerError(f"broker process {pid} survived SIGKILL")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        # noida prints a harmless loader warning about an optional GLIBC symbol on Debian 12.
        kept = [line for line in text if "GLIBC_" not in line][-lines:]
        return "\n".join(kept) if kept else "(empty log)"
