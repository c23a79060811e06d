"""A local Mooncake Store cluster (master and holders) in a private network namespace, the fixture of the remote
tests and benchmarks: Mooncake's clients listen on every interface, so it runs only where loopback is all there is."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NETNS_ENV = "TIERGRAM_NETNS"  # set to 1 inside the namespace run_in_netns creates
_PR_SET_PDEATHSIG = 1


def private_netns() -> bool:
    """True when this process's network namespace has no interface but loopback."""
    try:  # /proc/self/net is this namespace's view (/sys/class/net may show the host's)
        lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


def run_in_netns(argv: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
                 capture: bool = False) -> subprocess.CompletedProcess:
    """Run argv in a new network namespace with only loopback up (`unshare -n`; needs root)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise RuntimeError("a private network namespace needs `unshare` (util-linux) and `ip` (iproute2)")
    if os.geteuid() != 0:
        raise PermissionError("Mooncake's clients listen on every interface; tiergram runs a local cluster only in "
                              "a private network namespace, which needs root (unshare -n)")
    full_env = {**os.environ, **(env or {}), NETNS_ENV: "1"}
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]
    return subprocess.run(cmd, env=full_env, timeout=timeout, capture_output=capture, text=capture, check=False)


def _die_with_parent() -> None:
    # the child gets SIGKILL when the process that started it dies: no master or holder outlives a crashed run
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; its log: {log}\n{_tail(log)}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g} s; its log: {log}")


def _tail(log: Path, n: int = 2000) -> str:
    return _read_bytes(log).decode(errors="replace")[-n:]


def master_binary() -> str:
    """The mooncake_master executable: on PATH, else the copy inside the installed mooncake package."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        inside = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
        if inside.is_file() and os.access(inside, os.X_OK):
            return str(inside)
    raise RuntimeError("mooncake_master not found: pip install 'tiergram[remote]'")


class LocalCluster:
    """A `mooncake_master` on 127.0.0.1 and `holders` processes lending `segment_bytes` each; they die with us."""

    def __init__(self, log_dir: str | os.PathLike, *, holders: int = 1, segment_bytes: int = 256 << 20,
                 start_timeout: float = 20.0) -> None:
        if not private_netns():
            raise RuntimeError("refusing to start Mooncake outside a private network namespace (its clients "
                               "listen on every interface); run under tiergram.bench.mooncake_cluster.run_in_netns")
        self.master_bin = master_binary()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.start_timeout = start_timeout
        self.port = free_port()
        self.metrics_port = free_port()
        self.master_addr = f"127.0.0.1:{self.port}"
        self.master: subprocess.Popen | None = None
        self.holders: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        try:
            self.start_master()
            for _ in range(holders):
                self.add_holder()
        except BaseException:
            self.close()
            raise

    def _popen(self, argv: list[str], log_name: str) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / log_name
        f = open(log, "ab")  # noqa: SIM115 - kept open for the child's lifetime, closed in close()
        self._logs.append(f)
        env = {**os.environ, "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
               "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_die_with_parent)
        return proc, log

    def start_master(self) -> None:
        """Start (or restart, on the same port) the master; a restarted master has lost every key."""
        argv = [self.master_bin, "--rpc_address=127.0.0.1",
                f"--rpc_port={self.port}", "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}"]
        self.master, log = self._popen(argv, "master.log")
        _wait_port(self.port, self.master, self.start_timeout, "mooncake_master", log)

    def add_holder(self) -> subprocess.Popen:
        """Start one holder process lending segment_bytes to the store; returns it once it has joined."""
        i = len(self.holders)
        argv = [sys.executable, "-m", "tiergram.bench.mooncake_cluster", "holder", self.master_addr,
                str(self.segment_bytes)]
        log = self.log_dir / f"holder{i}.log"
        start = log.stat().st_size if log.exists() else 0  # a reused log folder: only this run's lines count
        proc, log = self._popen(argv, log.name)
        deadline = time.monotonic() + self.start_timeout
        while b"holder ready" not in _read_bytes(log)[start:]:
            if proc.poll() is not None:
                raise RuntimeError(f"holder {i} exited with code {proc.returncode}; its log: {log}\n{_tail(log)}")
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"holder {i} did not join the master within {self.start_timeout:g} s")
            time.sleep(0.05)
        self.holders.append(proc)
        return proc

    def kill_master(self) -> None:
        """SIGKILL the master by pid and reap it."""
        if self.master is not None and self.master.poll() is None:
            os.kill(self.master.pid, signal.SIGKILL)
            self.master.wait()

    def kill_holder(self, i: int = 0) -> None:
        """SIGKILL holder i by pid and reap it (its objects are lost unless replicated elsewhere)."""
        proc = self.holders[i]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def freeze(self, which: str = "holder", i: int = 0, *, resume: bool = False) -> None:
        """SIGSTOP (resume: SIGCONT) the master or holder i by pid: a process that hangs without dying."""
        proc = self.master if which == "master" else self.holders[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT if resume else signal.SIGSTOP)

    def close(self) -> None:
        """Kill every process this cluster started (by pid) and close the logs."""
        for proc in [*self.holders, self.master]:
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _holder_main(master: str, segment_bytes: int, local_hostname: str = "127.0.0.1") -> int:
    """A holder lending memory to the cluster, reached at local_hostname, until its stdin closes (its parent went)."""
    from mooncake.store import MooncakeDistributedStore  # not tiergram.tiers.mooncake: no torch import here

    for k in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
        os.environ.setdefault(k, "65535")  # batches over ~1,024 keys wedge a client without them
    store = MooncakeDistributedStore()
    rc = store.setup(local_hostname, "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"holder setup against {master} failed: {rc}", flush=True)
        return 1
    print("holder ready", flush=True)
    try:
        sys.stdin.buffer.read()  # EOF when the parent closes the pipe or dies
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "holder":
        sys.exit(_holder_main(sys.argv[2], int(sys.argv[3]), *sys.argv[4:]))
    sys.exit(f"usage: python -m tiergram.bench.mooncake_cluster holder MASTER SEGMENT_BYTES [LOCAL_HOSTNAME] "
             f"(got {sys.argv[1:]})")
