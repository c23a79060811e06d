"""`tiergram bench serve`'s configuration: the placements it can sweep, the load's shape, the servers' labels."""

from __future__ import annotations

import re
from dataclasses import dataclass

PLACEMENTS = ("device", "host", "file", "mooncake")
DEFAULT_PLACEMENTS = ("device", "host", "file")  # mooncake needs a master or a private network namespace


@dataclass
class SweepConfig:
    """What to sweep and how the load is shaped."""

    model_dir: str
    placements: tuple[str, ...] = DEFAULT_PLACEMENTS
    input_len: int = 128
    output_len: int = 32
    max_concurrency: int = 64
    requests_per_user: int = 4  # measured requests per point and round = this x concurrency
    warmup_per_user: int = 2  # warm-up requests per point = this x concurrency (before the first round)
    rounds: int = 3  # interleaved rounds per point: each placement in turn serves the same requests
    device_memory: int | None = None  # device memory budget of the engine (bytes)
    cache_fraction: float = 0.10  # file placement: host cache per layer, as a fraction of that layer's table
    cache_policy: str = "lru"  # the engine announces one step ahead: lookahead adds cost, not hits
    read_ahead: bool = True  # file placement: prompt rows read into the cache before their step
    torch_threads: int = 0  # each server's torch CPU threads (0: torch's default)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    source: str = "auto"  # auto (corpus test split if built, else stdlib), corpus, stdlib
    corpus: str | None = None
    seed: int = 0
    startup_timeout_s: float = 300.0
    plot: str | None = None
    markdown: str | None = None
    # file placement at several cache sizes, each its own server labelled file-<pct>% (None: cache_fraction alone)
    cache_fractions: tuple[float, ...] | None = None
    # a second model (the same backbone and tokenizer, larger tables) served by the file placement as "file-big", with
    # a per-layer cache of big_cache_bytes (None: the same bytes as the first file placement's): tables larger than
    # the host's memory, at a fixed host-memory budget
    big_model_dir: str | None = None
    big_cache_bytes: int | None = None
    host_memory: int | None = None  # every server's --host-memory (bytes)
    # mooncake placement: the mooncake_master's HOST:PORT (None: a local cluster started for the sweep, which needs
    # a private network namespace: docs/remote.md); its cache is the file placement's first fraction
    mooncake_master: str | None = None
    # also serve the first file placement with the engine's prompt_rows_first off, labelled <label>-nowait
    compare_rows_first: bool = False
    # also serve the host placement with the engine in a process of its own, labelled host-process
    compare_engine_process: bool = False
    # also serve the first file placement with --no-fixed-buffers (plain page reads), labelled <label>-plain
    compare_fixed_buffers: bool = False
    # also serve the first file placement with --no-read-ahead-yield (its read-ahead never gives way to a step's
    # reads at the disk), labelled <label>-greedy
    compare_read_ahead_yield: bool = False
    # also serve the first file placement with --read-nice N (its page-read threads at nice N), labelled <label>-nice
    compare_read_nice: int | None = None
    # also serve host and the first file placement with --torch-threads N, labelled host-tN and <label>-tN: what the
    # compute's thread count costs each placement, the file one's page reads needing a core of their own
    compare_torch_threads: int | None = None
    # also serve host and the first file placement with OMP_WAIT_POLICY=PASSIVE (torch's OpenMP workers sleep at once
    # after each parallel region instead of spinning on a core the HTTP loop and the reads need), labelled -passive
    compare_passive_waits: bool = False
    # also serve host and the first file placement with --engine-core (the step thread alone on one CPU, the HTTP loop
    # and the read threads on the rest), labelled -core, the file one held against host-core
    compare_engine_core: bool = False
    # file and mooncake servers preload their cache with their model's hot rows (MODEL_DIR/hot_rows.npz, written by
    # `tiergram hot-rows`) at start
    hot_rows: bool = False
    # with hot_rows: also serve the first file placement (and mooncake) without the preload, labelled <label>-cold
    compare_hot_rows: bool = False
    # also serve the mooncake placement with --mooncake-busy-waits (its client spins at normal priority), mooncake-busy
    compare_busy_waits: bool = False
    # seconds of the CPU speed probe (`bench.common.cpu_speed_ms`) before and after each placement's round, while
    # the servers idle: `plan validate` predicts the sweep at its probes' median speed (0: no probes)
    speed_probe_s: float = 0.25

    def __post_init__(self) -> None:
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad or not self.placements:
            raise ValueError(f"unknown placements {bad} (valid: {', '.join(PLACEMENTS)})")
        if min(self.input_len, self.output_len, self.max_concurrency, self.requests_per_user, self.rounds) < 1:
            raise ValueError("input_len, output_len, max_concurrency, requests_per_user and rounds must be >= 1")
        if self.speed_probe_s < 0:
            raise ValueError(f"speed_probe_s must be >= 0, got {self.speed_probe_s}")
        if self.warmup_per_user < 0 or self.torch_threads < 0:
            raise ValueError(f"warmup_per_user and torch_threads must be >= 0, got {self.warmup_per_user}, "
                             f"{self.torch_threads}")
        if not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        if self.cache_fractions is not None:
            self.cache_fractions = tuple(float(f) for f in self.cache_fractions)
            if not self.cache_fractions or any(not 0 < f <= 1 for f in self.cache_fractions):
                raise ValueError(f"cache_fractions must each be in (0, 1], got {self.cache_fractions}")

    @property
    def fractions(self) -> tuple[float, ...]:
        """The file placement's cache fractions."""
        return self.cache_fractions or (self.cache_fraction,)

    def labels(self) -> list[str]:
        """Every server of the sweep: the placements, the file one once per cache fraction, then file-big."""
        out = []
        for p in self.placements:
            if p == "file" and len(self.fractions) > 1:
                out += [file_label(f) for f in self.fractions]
            else:
                out.append(p)
        def first_file() -> str | None:
            """The first file server that is not itself a compared one: the one the compare flags copy."""
            return next((lb for lb in out if kind_of(lb) == "file" and base_label(lb) == lb), None)

        for on, suffix, flag in ((self.compare_rows_first, NOWAIT, "compare_rows_first"),
                                 (self.compare_fixed_buffers, PLAIN, "compare_fixed_buffers"),
                                 (self.compare_read_ahead_yield, GREEDY, "compare_read_ahead_yield"),
                                 (self.compare_read_nice is not None, NICE, "compare_read_nice")):
            if on:
                if (first := first_file()) is None:
                    raise ValueError(f"{flag} needs the file placement")
                out.insert(out.index(first) + 1, first + suffix)
        if self.compare_read_nice is not None and not -20 <= self.compare_read_nice <= 19:
            raise ValueError(f"compare_read_nice must be in -20..19, got {self.compare_read_nice}")
        if self.compare_torch_threads is not None and self.compare_torch_threads < 1:
            raise ValueError(f"compare_torch_threads must be >= 1, got {self.compare_torch_threads}")
        # host and the first file server again, the file one held against the host one (serve_stats.checks)
        for on, suffix, flag in ((self.compare_torch_threads is not None,
                                  threads_suffix(self.compare_torch_threads or 1), "compare_torch_threads"),
                                 (self.compare_passive_waits, PASSIVE, "compare_passive_waits"),
                                 (self.compare_engine_core, CORE, "compare_engine_core")):
            if on:
                if (first := first_file()) is None or "host" not in out:
                    raise ValueError(f"{flag} needs the host and file placements")
                out.insert(out.index("host") + 1, "host" + suffix)
                out.insert(out.index(first) + 1, first + suffix)
        if self.compare_hot_rows:
            first = first_file()
            if (first is None and "mooncake" not in out) or not self.hot_rows:
                raise ValueError("compare_hot_rows needs hot_rows and the file or mooncake placement")
            for label in (first, "mooncake"):
                if label in out:
                    out.insert(out.index(label) + 1, label + COLD)
        if self.compare_busy_waits:
            if "mooncake" not in out:
                raise ValueError("compare_busy_waits needs the mooncake placement")
            out.insert(out.index("mooncake") + 1, "mooncake" + BUSY)
        if self.compare_engine_process:
            if "host" not in out:
                raise ValueError("compare_engine_process needs the host placement")
            out.insert(out.index("host") + 1, "host" + PROCESS)
        if self.big_model_dir:
            out.append("file-big")
        return out


NOWAIT = "-nowait"  # the label suffix of a file server whose new prompts join at once (prompt_rows_first off)
PROCESS = "-process"  # the label suffix of a server whose engine runs in a process of its own
PLAIN = "-plain"  # the label suffix of a file server that reads pages without registered buffers
COLD = "-cold"  # the label suffix of a file or mooncake server that starts with an empty cache (no hot-rows preload)
BUSY = "-busy"  # the label suffix of a mooncake server whose store client spins at normal priority
GREEDY = "-greedy"  # the label suffix of a file server whose read-ahead never gives way to a step's reads
NICE = "-nice"  # the label suffix of a file server whose page-read threads run at compare_read_nice
PASSIVE = "-passive"  # the label suffix of a server whose torch OpenMP workers wait passively (OMP_WAIT_POLICY)
CORE = "-core"  # the label suffix of a server whose engine thread has a CPU of its own (--engine-core)


def file_label(fraction: float) -> str:
    """file-10% for a cache of 10% of the table."""
    return f"file-{100 * fraction:g}%"


# the suffixes of a server compared with the one it is named after
COMPARED = (NOWAIT, PROCESS, PLAIN, COLD, BUSY, GREEDY, NICE, PASSIVE, CORE)


def threads_suffix(threads: int) -> str:
    """-t1: the label suffix of a server whose torch compute runs on `threads` threads (compare_torch_threads)."""
    return f"-t{threads}"


def base_label(label: str) -> str:
    """The server a compared one is named after (file-10%-nowait -> file-10%; host-t1 -> host; host -> host): the
    same placement and cache."""
    for suffix in COMPARED:
        if label.endswith(suffix):
            return label.removesuffix(suffix)
    return re.sub(r"-t\d+$", "", label)


def kind_of(label: str) -> str:
    """The placement kind a server label runs (file-10% and file-big are file, host-process is host)."""
    return "file" if label.startswith("file") else base_label(label)


def levels(limit: int, max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to min(limit, max_concurrency), ending at that cap (at least [1])."""
    cap = max(1, min(limit, max_concurrency))
    out = [1]
    while out[-1] * 2 <= cap:
        out.append(out[-1] * 2)
    return out if out[-1] == cap else [*out, cap]


def round_order(members: list[str], r: int) -> list[str]:
    """The servers' turns in round r: forward in even rounds, backward in odd ones, each pair rotated on by one
    every two rounds, so that over 2 x len(members) rounds every server goes first, and goes before every other,
    equally often. Two file servers of the same table serve the same requests: the second reads pages the first
    has just read, which a cache under the disk (this VM's volume keeps what it served) returns many times faster."""
    base = members if r % 2 == 0 else members[::-1]
    k = (r // 2) % max(1, len(members))
    return base[k:] + base[:k]
