"""The servers of `bench serve` and `bench soak`: `tiergram serve` subprocesses, their caches, memory and CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tiergram.bench.serve_config import SweepConfig, file_label


class ServeSubprocess:
    """`tiergram serve MODEL_DIR --config FILE` on a free loopback port, healthy once entered."""

    def __init__(self, model_dir: str | os.PathLike, *, config: dict[str, Any] | None = None,
                 startup_timeout_s: float = 300.0) -> None:
        self.config_file = tempfile.NamedTemporaryFile("w", prefix="tiergram-serve-", suffix=".json")
        json.dump(config or {}, self.config_file)
        self.config_file.flush()
        self.cmd = [sys.executable, "-m", "tiergram", "serve", str(model_dir), "--config", self.config_file.name,
                    "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
        self.timeout = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> ServeSubprocess:
        """Start it and wait until /health answers 200 (the process is stopped again if it never does)."""
        import httpx

        self.log = tempfile.TemporaryFile(mode="w+")  # stderr: a file, so a chatty server never blocks on a pipe
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = self.proc.stdout.readline()  # "tiergram serve: NAME on http://127.0.0.1:PORT" once bound
            if " on http://" not in line:
                self.proc.wait(30)
                raise RuntimeError(f"the server did not start ({' '.join(self.cmd)}):\n{line}{self.stderr()}")
            self.url = line.strip().rsplit(" on ", 1)[1]
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            raise RuntimeError(f"the server at {self.url} did not become healthy in {self.timeout:.0f} s (exit "
                               f"status {self.proc.poll()}):\n{self.stderr()}")
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def stderr(self) -> str:
        """The last 4000 characters the server wrote to stderr."""
        self.log.seek(0)
        return self.log.read()[-4000:]

    def kill9(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL if it does not exit within a minute."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill9()

    def __enter__(self) -> ServeSubprocess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.log.close()
        self.config_file.close()


class ServerProcess(ServeSubprocess):
    """A sweep's server: `tiergram serve --config` with the sweep's engine settings for one of its servers."""

    def __init__(self, cfg: SweepConfig, label: str, cache_bytes: int, max_waiting: int,
                 model_dir: str | None = None) -> None:
        self.settings = server_settings(cfg, label, cache_bytes, max_waiting, model_dir)
        super().__init__(model_dir or cfg.model_dir, config=self.settings.to_dict())


def server_settings(cfg: SweepConfig, label: str, cache_bytes: int, max_waiting: int, model_dir: str | None = None):
    """One server's typed configuration: the sweep's engine, its placement and cache, its variant's."""
    from tiergram.model.hot_rows import HOT_ROWS
    from tiergram.settings import EngineSettings, ServerSettings, ServeSettings

    kind = cfg.kind_of(label)
    cached = kind in ("file", "mooncake")
    engine = EngineSettings(placement=kind, cache_bytes=cache_bytes if cached else 0, cache_policy=cfg.cache_policy,
                            mooncake_master=cfg.mooncake_master or "" if kind == "mooncake" else "",
                            device_memory=cfg.device_memory, host_memory=cfg.host_memory, block_size=cfg.block_size,
                            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                            max_waiting=max_waiting, torch_threads=cfg.torch_threads)
    changes = {**cfg.engine, **(cfg.variants[label].engine if label in cfg.variants else {})}
    hot = changes.pop("hot_rows", cfg.hot_rows)  # true: the model's own file; a path: that file
    if hot and cached:
        engine.hot_rows = hot if isinstance(hot, str) else str(Path(model_dir or cfg.model_dir) / HOT_ROWS)
        if not Path(engine.hot_rows).is_file():
            raise FileNotFoundError(f"--hot-rows: no {engine.hot_rows}; write it with `tiergram hot-rows MODEL_DIR`")
    engine = replace(engine, **changes)
    if not cached:  # the sweep's cache settings are the file and mooncake servers'
        engine.cache_bytes = 0
    engine.check()
    return ServeSettings(engine=engine, server=ServerSettings(host="127.0.0.1", port=0, log_level="warning"))


def _read(path: str) -> str:
    """A /proc file's text ('' when the process or thread is gone)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def peak_rss(pid: int) -> int:
    """Peak resident memory (VmHWM) of a live process and its descendants, bytes (0: unreadable)."""
    own = next((int(line.split()[1]) * 1024 for line in _read(f"/proc/{pid}/status").splitlines()
                if line.startswith("VmHWM:")), 0)
    return own + sum(peak_rss(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    """The pids of a process's children (every thread's list: a child belongs to the thread that forked it)."""
    return [int(x) for tid in _tasks(pid) for x in _read(f"/proc/{pid}/task/{tid}/children").split()]


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a process tree's threads per name, as `thread_cpu_seconds{name=...}` samples."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for proc in [pid, *_children(pid)]:
        for tid in _tasks(proc):
            stat = _read(f"/proc/{proc}/task/{tid}/stat")
            if not stat:
                continue  # the thread ended meanwhile
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()  # fields 14 and 15 of proc(5), from field 3 on
            key = f'thread_cpu_seconds{{name="{name}"}}'
            out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics samples."""
    import httpx

    from tiergram.server.metrics import parse

    return parse(httpx.get(f"{url}/metrics", timeout=30).text)


def layer_tables(model_dir: str, codec: str = "fp8_e4m3") -> list[Path]:
    """Each Engram layer's table file (exported first, as the engine would, when missing)."""
    from tiergram.engine.tables import export_dir_for
    from tiergram.model.model_dir import ModelDir

    model = ModelDir.open(model_dir)
    if not model.engram_layers:
        raise ValueError(f"{model_dir} has no Engram layers: there is no table to place")
    src = export_dir_for(model, model.engram_layers, {codec})
    return [src.table_path(layer, codec) for layer in model.engram_layers]


def layer_table_bytes(model_dir: str, codec: str = "fp8_e4m3") -> list[int]:
    """Bytes of each Engram layer's table file."""
    return [path.stat().st_size for path in layer_tables(model_dir, codec)]


def cache_budgets(cfg: SweepConfig, tables: list[Path]) -> dict[str, int]:
    """Each server's host cache per layer, bytes: a fraction of the smallest layer's table (a variant: its base's)."""
    smallest = min(path.stat().st_size for path in tables)
    caches = {file_label(f) if len(cfg.fractions) > 1 else "file": int(f * smallest) for f in cfg.fractions}
    first = int(cfg.fractions[0] * smallest)  # mooncake's, and file-big's unless big_cache_bytes says
    caches |= {"mooncake": first, "file-big": first if cfg.big_cache_bytes is None else cfg.big_cache_bytes}
    return {lb: cfg.variants[lb].engine.get("cache_bytes", caches.get(cfg.base_of(lb), 0)) if lb in cfg.variants
            else caches.get(lb, 0) for lb in cfg.labels()}
