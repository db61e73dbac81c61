"""The long-lived persist process ("checkpoint service") and the client channel workers use to feed it.

One service process writes snapshots from shared-memory slots to disk and remote storage, one at a time, at
lowered priority (``nice``) and under an optional bandwidth cap, so it never starves training. Workers send it
small JSON requests over a unix socket (newline-delimited); tensors never travel through the socket.

Two ways to run it:

* **Agent-owned** (under ``trainguard run``): the node agent starts one service per job and puts its socket path
  in each worker's environment under :data:`~trainguard.checkpoint.config.CHECKPOINT_SERVICE_ENV`. The service,
  and the job's shared-memory arena, outlive crashed workers, so a restarted worker restores from memory and
  persists of the dead worker's last snapshot still complete. The agent removes the arena when the job ends::

      from trainguard.checkpoint.service import CheckpointService
      from trainguard.checkpoint.config import CHECKPOINT_SERVICE_ENV

      svc = CheckpointService(job="demo").start()        # once per job, before spawning workers
      env[CHECKPOINT_SERVICE_ENV] = svc.address         # for each worker
      ...
      svc.stop(remove_memory=True)                      # when the job is over (not on a worker restart)

* **Private** (plain ``python``/``torchrun``, no variable set): each ``Checkpointer`` spawns its own service,
  which exits after its worker disconnects and its queue drains. The arena files stay in tmpfs after a crash, so
  a restarted worker still restores from memory; a clean ``close()`` removes them.

Run by hand: ``python -m trainguard.checkpoint.service --socket /run/trainguard/ckpt.sock``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import select
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

from trainguard.checkpoint.arena import remove_job
from trainguard.checkpoint.channel import PersistChannel
from trainguard.checkpoint.config import CheckpointConfig, MemoryTierConfig
from trainguard.checkpoint.errors import CheckpointError, StorageUnavailableError
from trainguard.checkpoint.uploads import UploadQueue

log = logging.getLogger(__name__)

#: What this service reads beyond the first protocol, announced in its welcome: ``manifest_text``, a persist
#: request's manifest as its own JSON text (a service without it reads only the decoded object).
FEATURES = ("manifest_text",)
#: Longest request line the service reads: a persist request carries the snapshot's manifest (a few hundred
#: bytes a tensor), so this is about a million tensors; a client sending more without a newline is dropped (its
#: buffer grew without bound).
MAX_REQUEST_BYTES = 256 << 20
#: How long a worker waits for the service's welcome before its first request (it comes at once from a live one).
WELCOME_WAIT_S = 5.0

Report = Callable[[dict[str, Any]], None]


# ====================================================================== server (the persist process)
class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.open = True

    def send(self, msg: dict[str, Any]) -> None:
        if not self.open:
            return
        data = (json.dumps(msg) + "\n").encode()
        with self.lock:
            try:
                self.sock.sendall(data)
            except OSError:
                self.open = False  # the worker is gone; its persist still completes


class PersistServer:
    """The service's event loop: accepts workers, queues their requests, persists them in order.

    Args:
        socket_path: unix socket to listen on.
        private: exit once every client disconnected and the queue is empty (or the parent died).
        parent_pid: in private mode, also exit when this process is gone and nothing is queued.
    """

    def __init__(self, socket_path: str, private: bool = False, parent_pid: int | None = None) -> None:
        self.socket_path = socket_path
        self.private = private
        self.parent_pid = parent_pid
        self.work: queue.Queue[tuple[_Conn, dict[str, Any]] | None] = queue.Queue()
        self.uploads = UploadQueue()  # remote uploads, after the slots are free (see checkpoint/uploads.py)
        self.clients = 0
        self.ever_connected = False
        self.busy = 0
        self.stopping = threading.Event()
        self._state = threading.Lock()

    def serve(self) -> None:
        """Runs until a shutdown request (or, in private mode, until orphaned and idle)."""
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        srv.listen(64)
        worker = threading.Thread(target=self._work_loop, name="persist", daemon=True)
        worker.start()
        try:
            while not self.stopping.is_set():
                ready, _, _ = select.select([srv], [], [], 0.2)
                if ready:
                    conn, _ = srv.accept()
                    with self._state:
                        self.clients += 1
                    threading.Thread(target=self._read_loop, args=(_Conn(conn),), daemon=True).start()
                if self.private and self._idle() and (self.ever_connected or not self._parent_alive()):
                    break
        finally:
            srv.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        # Drain: a shutdown waits for everything already queued, uploads included.
        self.work.put(None)
        worker.join()
        self.uploads.wait_idle()

    def _parent_alive(self) -> bool:
        if self.parent_pid is None:
            return True
        try:
            os.kill(self.parent_pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _idle(self) -> bool:
        with self._state:
            quiet = self.clients == 0 and self.busy == 0 and self.work.empty()
        return quiet and self.uploads.idle()

    def _read_loop(self, conn: _Conn) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = conn.sock.recv(1 << 16)
                if not chunk:
                    break
                # Only the new bytes are searched: scanning the whole buffer per chunk was quadratic in a long line.
                end = chunk.find(b"\n")
                if end < 0:
                    buf += chunk
                    if len(buf) > MAX_REQUEST_BYTES:
                        raise ValueError(f"a request line of over {MAX_REQUEST_BYTES >> 20} MiB without a newline")
                    continue
                start = len(buf) + end
                buf += chunk
                while start >= 0:
                    line = bytes(buf[:start])
                    del buf[:start + 1]
                    start = buf.find(b"\n")
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if isinstance(msg, dict):
                        self._handle(conn, msg)
                    else:  # valid JSON, but no request: answered, where it killed the reader with a traceback
                        conn.send({"op": "error", "error": f"a request is a JSON object, not {type(msg).__name__}"})
                if len(buf) > MAX_REQUEST_BYTES:
                    raise ValueError(f"a request line of over {MAX_REQUEST_BYTES >> 20} MiB without a newline")
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested 200,000 deep
            log.warning("checkpoint service: client connection dropped: %s", exc)
        finally:
            conn.open = False
            conn.sock.close()
            with self._state:
                self.clients -= 1

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        # Only a client that spoke counts (start-up probes connect and leave silently).
        self.ever_connected = True
        if op == "hello":
            conn.send({"op": "welcome", "pid": os.getpid(), "features": list(FEATURES)})
        elif op == "persist":
            with self._state:
                self.busy += 1
            self.work.put((conn, msg))
        elif op == "ping":
            conn.send({"op": "pong", "pid": os.getpid()})
        elif op == "drain":
            # Replies once everything queued before this request is persisted.
            with self._state:
                self.busy += 1
            self.work.put((conn, msg))
        elif op == "shutdown":
            self.stopping.set()
        else:
            conn.send({"op": "error", "error": f"unknown op {op!r}"})

    def _work_loop(self) -> None:
        from trainguard.checkpoint.persist import persist_snapshot

        while True:
            item = self.work.get()
            if item is None:
                return
            conn, msg = item
            try:
                if msg.get("op") == "drain":
                    self.uploads.wait_idle()  # "drained" promises the uploads queued before it too
                    conn.send({"op": "drained"})
                else:
                    persist_snapshot(msg, conn.send, self.uploads)
            except Exception as exc:  # one bad request must not kill the service
                log.exception("persist of step %s failed", msg.get("step"))
                conn.send({"op": "tier", "id": msg.get("id"), "step": msg.get("step"), "tier": "disk", "ok": False,
                           "error": f"persist crashed: {exc!r}", "errno": 0})
                conn.send({"op": "released", "id": msg.get("id"), "step": msg.get("step")})
            finally:
                with self._state:
                    self.busy -= 1


# ====================================================================== agent-side handle
class CheckpointService:
    """Starts and stops a checkpoint service process (the node agent runs one per job).

    A process that dies while the job runs (an OOM kill, a stray ``kill -9``) is started again at the same
    socket, with a growing pause between restarts of one that keeps dying: the workers' checkpointers reconnect
    at their next save. Without that, every later persist of the node failed for the rest of the job (the
    durable tiers silently gone: "connection refused" at each save) while the job reported success.

    Args:
        job: job name (used to remove its shared-memory arena on ``stop``).
        socket_path: where to listen; default a fresh path under the temp directory.
        shm_dir: the arena's tmpfs root (default ``$TRAINGUARD_CHECKPOINT_SHM_DIR`` or ``/dev/shm/trainguard``).
        nice: niceness of the service process (0..19).
        on_restart: called with the old and the new process id after a restart (the launcher's guard forgets
            the dead one's group and watches the new one's).
    """

    #: Pause before restarting a service that died, seconds; doubled per death within a minute of the last
    #: start, up to :attr:`MAX_RESTART_DELAY_S`.
    RESTART_DELAY_S = 0.2
    MAX_RESTART_DELAY_S = 30.0

    def __init__(self, job: str = "default", socket_path: str | None = None, shm_dir: str | None = None,
                 nice: int = 10, on_restart: Callable[[int, int], None] | None = None) -> None:
        self.job = job
        self.address = socket_path or default_socket_path(f"trainguard-ckpt-{os.getpid()}")
        # The workers' default (MemoryTierConfig): an empty variable is unset. Read as "", the arena root was the
        # working directory, and stop() removed the folder named like the job there.
        self.shm_dir = shm_dir or MemoryTierConfig().directory
        self.nice = nice
        self.on_restart = on_restart
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # orders a restart's swap of ``proc`` against stop()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the service, or None when not running."""
        proc = self.proc
        return proc.pid if proc else None

    def start(self, timeout: float = 30.0) -> "CheckpointService":
        """Spawns the service, waits until it accepts connections, and keeps it running until :meth:`stop`.

        Returns:
            self, for chaining.

        Raises:
            CheckpointError: the process exited or did not listen within ``timeout`` seconds.
        """
        self.proc = _spawn(self.address, private=False, nice=self.nice)
        _wait_listening(self.address, self.proc, timeout)
        self._stopping.clear()
        self._watcher = threading.Thread(target=self._keep_running, name="ckpt-service-watch", daemon=True)
        self._watcher.start()
        return self

    def _keep_running(self) -> None:
        delay = self.RESTART_DELAY_S
        started = time.monotonic()
        while not self._stopping.is_set():
            proc = self.proc
            if proc is None:
                return
            try:
                code = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            if self._stopping.is_set():
                return
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            if self.restarts and time.monotonic() - started < 60.0:
                delay = min(delay * 2, self.MAX_RESTART_DELAY_S)  # it keeps dying: do not spin
            else:
                delay = self.RESTART_DELAY_S
            log.error("the checkpoint service of job %s (pid %d) ended with %s while the job runs; the persists it "
                      "had not finished are lost (reported to the workers); starting it again in %.1f s",
                      self.job, proc.pid, how, delay)
            new = None
            while new is None:
                if self._stopping.wait(delay):
                    return
                try:
                    new = _spawn(self.address, private=False, nice=self.nice)
                    _wait_listening(self.address, new, 30.0)
                except (OSError, CheckpointError) as exc:
                    new = None
                    delay = min(delay * 2, self.MAX_RESTART_DELAY_S)
                    log.error("cannot start the checkpoint service again: %s; retrying in %.1f s", exc, delay)
            with self._lock:
                if self._stopping.is_set():  # stop() came while it started: it must not outlive the job
                    new.kill()
                    new.wait()
                    return
                self.proc = new
            started = time.monotonic()
            self.restarts += 1
            log.warning("checkpoint service of job %s started again (pid %d, restart %d): the workers reconnect at "
                        "their next save", self.job, new.pid, self.restarts)
            if self.on_restart is not None:
                try:
                    self.on_restart(proc.pid, new.pid)
                except Exception:  # noqa: BLE001 - a callback must not end the supervision
                    log.exception("on_restart callback failed")

    def stop(self, remove_memory: bool = True, timeout: float = 120.0) -> None:
        """Drains queued persists, stops the process, and (by default) removes the job's shared-memory arena.

        Args:
            remove_memory: delete the arena (the job is over). Keep it when only restarting the service.
            timeout: seconds to wait for the drain before killing the process.
        """
        with self._lock:
            self._stopping.set()  # before the shutdown: its exit is not a death to restart from
        if self._watcher is not None:
            self._watcher.join(35.0)
            self._watcher = None
        if self.proc is not None:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(self.address)
                    s.sendall(b'{"op": "shutdown"}\n')
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        # A service killed with SIGKILL could not remove its socket file; nothing listens there any more.
        remove_socket_if_dead(self.address)
        if remove_memory:
            remove_job(self.shm_dir, self.job)

    def __enter__(self) -> "CheckpointService":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: Longest path a unix socket can be bound to (``sun_path`` is 108 bytes with its terminating NUL).
SOCKET_PATH_MAX = 107


def default_socket_path(stem: str) -> str:
    """A fresh socket path ``<dir>/<stem>-<random>.sock`` in the temp directory, else in ``/tmp`` or ``/dev/shm``
    when the temp directory's path is too long for a unix socket.

    HPC sites point ``$TMPDIR`` at per-job folders on scratch filesystems whose paths pass ``SOCKET_PATH_MAX``
    bytes: the persist process then failed to bind ("AF_UNIX path too long") and not one checkpoint was saved,
    each save reporting only that the service exited at start.

    Raises:
        CheckpointError: no candidate folder is both short enough and writable.
    """
    name = f"{stem}-{uuid.uuid4().hex[:8]}.sock"
    candidates = [tempfile.gettempdir(), "/tmp", "/dev/shm"]
    for d in candidates:
        path = os.path.join(d, name)
        if len(os.fsencode(path)) <= SOCKET_PATH_MAX and os.access(d, os.W_OK | os.X_OK):
            remove_stale_sockets(d)
            return path
    raise CheckpointError(f"no folder for the checkpoint service's socket: {', '.join(candidates)} are too long "
                          f"(over {SOCKET_PATH_MAX} bytes with the socket's name) or not writable; set TMPDIR to a "
                          "short writable folder")


#: Names of the sockets :func:`default_socket_path` makes: ``trainguard-ckpt-<pid of the creating process>-...``.
_SOCKET_NAME = re.compile(r"^trainguard-ckpt-(\d+)(?:-[^/]*)?\.sock$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def remove_socket_if_dead(path: str) -> bool:
    """Removes the unix socket file ``path`` when no process listens on it any more; True when removed.

    Only a socket file owned by this user is touched, and only when a connection to it is refused: the kernel
    refuses exactly when no socket is bound to that file any more (its process is gone, killed before it could
    remove the file). A live service accepts, so its file is never removed.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
            return False  # someone listens
        except ConnectionRefusedError:
            pass
        except OSError:
            return False  # a timeout (full backlog of a live one) or something odd: keep it
    try:
        # The same file still (not one a new service bound at that path between our look and now).
        if os.lstat(path).st_ino != st.st_ino:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def remove_stale_sockets(directory: str) -> list[str]:
    """Removes checkpoint-service sockets in ``directory`` left behind by dead processes; returns their paths.

    A persist process killed with SIGKILL (an OOM kill, ``kill -9``, a node agent's hard stop) cannot remove its
    socket file, and each private persist process gets a fresh name, so a long-lived node collected
    ``trainguard-ckpt-*.sock`` files in ``/tmp`` without bound. Removed here: files with the names
    :func:`default_socket_path` makes whose creating process (the pid in the name: the worker or the agent that
    owns the address) is gone and on which no process listens (see :func:`remove_socket_if_dead`). A socket of a
    live owner is kept even when nobody listens: an agent may be between two starts of its service there.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _SOCKET_NAME.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        if remove_socket_if_dead(path):
            removed.append(path)
    if removed:
        log.info("removed %d checkpoint-service socket(s) of dead processes in %s", len(removed), directory)
    return removed


def _spawn(address: str, private: bool, nice: int, parent_pid: int | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "trainguard.checkpoint.service", "--socket", address, "--nice", str(nice)]
    if private:
        cmd += ["--private", "--parent-pid", str(parent_pid or os.getpid())]
    # Own session: a Ctrl-C aimed at the training script must not kill a persist half-way; the service exits
    # by itself once its clients are gone and its queue is drained.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_listening(address: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckpointError(f"the checkpoint service exited with code {proc.returncode} at start; "
                                  "see its log on stderr")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(address)
                return
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise CheckpointError(f"the checkpoint service did not listen on {address} within {timeout:.0f} s")


# ====================================================================== worker-side channel
class ServiceChannel(PersistChannel):
    """A worker's connection to a checkpoint service (agent-owned or private).

    Args:
        sock: connected socket.
        report: receives every outcome message.
        proc: the private service process, when this channel spawned it.
        address: the private service's socket path (removed at close when that process died without removing it).
    """

    def __init__(self, sock: socket.socket, report: Report, proc: subprocess.Popen[bytes] | None,
                 address: str | None = None) -> None:
        self.sock = sock
        self.address = address
        self.report = report
        self.proc = proc
        self.owns_memory = proc is not None
        self._send_lock = threading.Lock()
        self._alive = True
        self._drained = threading.Event()
        self._welcome = threading.Event()
        self.features: frozenset[str] = frozenset()  # what the service announced (see FEATURES)
        self._reader = threading.Thread(target=self._read_loop, name="trainguard-ckpt-reader", daemon=True)
        self._reader.start()

    @classmethod
    def connect_or_spawn(cls, address: str | None, config: CheckpointConfig, job: str, rank: int,
                         report: Report) -> "ServiceChannel":
        """Connects to the service at ``address``, or spawns a private one when ``address`` is None.

        Raises:
            CheckpointError: connection or start failed.
        """
        proc = None
        if not address:
            address = default_socket_path(f"trainguard-ckpt-{os.getpid()}-{rank}")
            proc = _spawn(address, private=True, nice=config.persist.nice)
            _wait_listening(address, proc, 30.0)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            raise StorageUnavailableError(
                f"cannot connect to the checkpoint service at {address}: {exc.strerror or exc} (is the node agent "
                "running? unset TRAINGUARD_CHECKPOINT_SERVICE to use a private persist process)") from exc
        chan = cls(sock, report, proc, address if proc is not None else None)
        chan._send({"op": "hello", "job": job, "rank": rank})
        return chan

    def _read_loop(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if msg.get("op") == "drained":
                        self._drained.set()
                    elif msg.get("op") == "welcome":
                        said = msg.get("features")
                        self.features = frozenset(str(f) for f in said) if isinstance(said, list) else frozenset()
                        self._welcome.set()
                    elif msg.get("op") == "pong":
                        continue
                    else:
                        try:
                            self.report(msg)
                        except Exception:
                            log.exception("checkpoint report handler failed")
        except (OSError, ValueError):
            pass
        finally:
            self._alive = False
            self._drained.set()
            self._welcome.set()
            try:
                self.report({"op": "channel_closed"})
            except Exception:
                pass

    def _send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                self._alive = False
                raise StorageUnavailableError(f"the checkpoint service connection is broken ({exc}); "
                                              "the persist process died") from exc

    def submit(self, request: dict[str, Any]) -> None:
        manifest = request.get("manifest")
        if isinstance(manifest, str) and not self._speaks("manifest_text"):
            # The node agent's service runs the trainguard its launcher started with: a worker restarted after
            # an upgrade failed every persist there ("string indices must be integers"). Such a service gets the
            # decoded object it reads (one more JSON pass per save, for as long as that launcher runs).
            request = {**request, "manifest": json.loads(manifest)}
        self._send(request)

    def _speaks(self, feature: str) -> bool:
        """Whether the service announced ``feature`` (waits for its welcome, once, at most WELCOME_WAIT_S)."""
        if not self._welcome.wait(WELCOME_WAIT_S):
            log.warning("the checkpoint service sent no welcome within %.0f s; taking it for an older one",
                        WELCOME_WAIT_S)
            self._welcome.set()
        return feature in self.features

    def drain(self, timeout: float | None = None) -> bool:
        """Blocks until the service persisted everything this channel queued; False on timeout or death."""
        self._drained.clear()
        try:
            self._send({"op": "drain"})
        except CheckpointError:
            return False
        return self._drained.wait(timeout) and self._alive

    def alive(self) -> bool:
        return self._alive

    def close(self) -> None:
        if self.sock.fileno() < 0:
            return
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._reader is not threading.current_thread():
            # shutdown() ends its recv at once; joining it means a closed channel leaves no thread behind.
            self._reader.join(timeout=5.0)
        if self.proc is not None:
            # The private service exits once its only client left and its queue drained.
            try:
                self.proc.wait(600)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            # A private service killed with SIGKILL left its socket file; the worker starts the next one at a new
            # path, so without this a long-lived worker kept one stale file per death.
            if self.address is not None:
                remove_socket_if_dead(self.address)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.checkpoint.service``: run a checkpoint service in the foreground."""
    p = argparse.ArgumentParser(description="trainguard checkpoint service (persist process)")
    p.add_argument("--socket", required=True, help="unix socket path to listen on")
    p.add_argument("--private", action="store_true", help="exit once clients are gone and the queue is empty")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--nice", type=int, default=10, help="niceness increment (0..19)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s ckpt-service: %(message)s")
    if args.nice > 0:
        try:
            os.nice(args.nice)
        except OSError:
            pass
    PersistServer(args.socket, private=args.private, parent_pid=args.parent_pid).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
