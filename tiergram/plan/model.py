"""The planner's step model: what one serving step costs per placement, and what caps concurrency (no I/O; the
equations and their names are docs/planner.md's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

ENGRAM_SOURCE = {"device": "engram (device)", "host": "engram (host DRAM)", "file": "engram (disk)"}  # by kind


@dataclass(frozen=True)
class EngramGeometry:
    """The Engram tables: which blocks read them, rows per token, bytes per row, rows per table."""

    layers: tuple[int, ...]  # block indices (0-based) with an Engram layer
    heads: int  # rows each token reads per Engram layer (all n-gram orders together)
    row_bytes: int  # one encoded row on disk / in memory
    rows_per_layer: int | tuple[int, ...]  # rows of one layer's table, or one count per layer in `layers` order

    @property
    def rows_per_token(self) -> int:
        return len(self.layers) * self.heads

    @property
    def table_bytes(self) -> int:
        """All layers' tables, encoded."""
        rows = self.rows_per_layer
        return (sum(rows) if isinstance(rows, tuple) else len(self.layers) * rows) * self.row_bytes


@dataclass(frozen=True)
class MoeGeometry:
    """Routed experts: a step reads every distinct expert its tokens picked, once per block."""

    experts: int  # routed experts per MoE block
    experts_per_token: int  # routed experts each token activates per block
    layers: int  # MoE blocks a decode token runs through
    expert_bytes: float  # one routed expert's weights
    prefill_layers: int = 0  # MoE blocks a prompt token runs through (0: all `layers`)

    def distinct(self, tokens: float) -> float:
        """Expected distinct experts per block that `tokens` uniformly routed tokens touch."""
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** max(0.0, tokens))


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: compute and bytes per token, KV per token, Engram geometry."""

    name: str
    n_layers: int  # transformer blocks
    active_params: float  # parameters each token multiplies (MoE: the activated ones)
    weight_bytes: float  # all weights resident on the device (Engram tables excluded)
    active_weight_bytes: float  # weight bytes one token touches (dense: weight_bytes; MoE: activated experts)
    kv_bytes_per_token: float  # K/V cache bytes of one token of context, all layers
    engram: EngramGeometry
    activation_bytes: float = 0.0  # device reserve for one step's activations
    hit_rate_curve: tuple[tuple[float, float], ...] = ()  # (host cache fraction of the table, hit rate)
    hot_hit_rate_curve: tuple[tuple[float, float], ...] = ()  # the same, the cache preloaded with hot rows
    prefill_active_params: float = 0.0  # parameters a prompt token multiplies (an encoder-decoder's); 0: active
    kv_state_bytes_per_seq: float = 0.0  # K/V a sequence holds whatever its length (a sliding window's)
    moe: MoeGeometry | None = None  # routed experts: a step reads its distinct experts, not min(W, N·W_act)

    @property
    def flops_per_token(self) -> float:
        """2 FLOPs (multiply + add) per active parameter (a decode token's)."""
        return 2.0 * self.active_params

    @property
    def prefill_flops_per_token(self) -> float:
        """2 FLOPs per parameter a prompt token multiplies."""
        return 2.0 * (self.prefill_active_params or self.active_params)

    def step_flops(self, tokens: float, decode_tokens: float) -> float:
        """FLOPs of a step of `tokens` tokens, `decode_tokens` of them decode and the rest prompt tokens."""
        decode = min(tokens, decode_tokens)
        return decode * self.flops_per_token + (tokens - decode) * self.prefill_flops_per_token

    def step_weight_bytes(self, tokens: float, decode_tokens: float) -> float:
        """Weight bytes a step reads: dense min(W, N·W_act); MoE the non-expert weights plus the distinct experts."""
        if self.moe is None:
            return min(self.weight_bytes, tokens * self.active_weight_bytes)
        m = self.moe
        dense = self.active_weight_bytes - m.experts_per_token * m.layers * m.expert_bytes
        pre = m.prefill_layers or m.layers
        experts = pre * m.distinct(tokens) + (m.layers - pre) * m.distinct(min(tokens, decode_tokens))
        return min(self.weight_bytes, dense + experts * m.expert_bytes)

    @property
    def hide_fraction(self) -> float:
        """Share of a step's backbone compute that runs before the first Engram layer (embedding ≈ free)."""
        return min(self.engram.layers) / self.n_layers

    def hit_rate(self, cache_fraction: float, hot_rows: bool = False) -> float:
        """Hit rate of a host cache holding `cache_fraction` of the table (cold, or preloaded with hot rows)."""
        if hot_rows:
            if not self.hot_hit_rate_curve:
                raise ValueError(f"model spec {self.name!r} has no hot_hit_rate_curve: a placement with hot rows "
                                 "needs one (`tiergram bench cache --policies lru-hot` measures it)")
            return interpolate(self.hot_hit_rate_curve, cache_fraction, log_x=True)
        return interpolate(self.hit_rate_curve, cache_fraction, log_x=True) if self.hit_rate_curve else 0.0


@dataclass(frozen=True)
class DiskSpec:
    """The NVMe drives: random 4 KiB reads per second per drive at each queue depth, and CPU per page read."""

    drives: int
    iops_curve: tuple[tuple[float, float], ...]  # (queue depth per drive, pages/s per drive), increasing depth
    page_bytes: int = 4096
    cpu_s_per_page: float = 0.0  # host CPU seconds per page read (submit, complete, verify, copy out)
    threads: int = 1  # reader threads the CPU seconds spread over
    cache_pages_per_s: float = 0.0  # a cache under the drives (a VM's volume): re-reads' pages/s at QD 128

    @property
    def latency_s(self) -> float:
        """One read's latency: the inverse of a drive's rate at queue depth 1."""
        return 1.0 / interpolate(self.iops_curve, 1.0)

    def pages_per_s(self, queue_depth: float) -> float:
        """Pages/s of all drives with `queue_depth` reads in flight, spread evenly over the drives."""
        return self.drives * interpolate(self.iops_curve, max(1.0, queue_depth / self.drives), log_x=True)

    def at_limit(self, pages_per_s: float, queue_depth: float) -> DiskSpec:
        """These drives with the curve scaled so that `queue_depth` gives `pages_per_s` (its shape kept)."""
        k = pages_per_s / self.pages_per_s(queue_depth)
        return replace(self, iops_curve=tuple((q, r * k) for q, r in self.iops_curve))

    def with_rereads(self, reread_share: float) -> DiskSpec:
        """These drives when `reread_share` of the reads are re-reads, served at the cache's rate (docs/planner.md)."""
        drives = self.pages_per_s(128)
        if not 0.0 <= reread_share <= 1.0:
            raise ValueError(f"reread_share must be in [0, 1], got {reread_share}")
        if self.cache_pages_per_s <= drives:
            return self
        k = 1.0 / (1.0 - reread_share + reread_share * drives / self.cache_pages_per_s)
        return replace(self, iops_curve=tuple((q, r * k) for q, r in self.iops_curve))


@dataclass(frozen=True)
class HardwareSpec:
    """A machine: the device (HBM or, on a CPU-only machine, a budget of host memory), host DRAM, link, disks."""

    name: str
    kind: str  # "gpu": device and host are separate, joined by the link; "cpu": one pool of cores does everything
    device_memory_bytes: float  # what weights + device tables + activations + KV may use
    device_bw: float  # device memory bandwidth, bytes/s
    compute_flops: float  # sustained backbone FLOP/s (peak × the efficiency stated in the spec)
    step_overhead_s: float  # fixed cost of one step (scheduler, launches, sampling)
    per_seq_s: float  # cost per running sequence per step (sampling, streaming, bookkeeping)
    host_memory_bytes: float  # host DRAM the server may use
    host_bw: float  # host DRAM bandwidth, bytes/s
    gather_rows_s: float  # host gather + dequant rate, rows/s (cpu: native threads on these cores)
    link_bw: float  # host -> device bytes/s (PCIe / NVLink-C2C); 0 on a CPU-only machine
    disk: DiskSpec
    per_token_s: float = 0.0  # measured backbone seconds per token of the calibrated model (informational)
    request_overhead_s: float = 0.0  # per request: HTTP, tokenizing, admission (one user's gap between requests)
    gather_call_s: float = 0.0  # fixed cost of the host tier's lookups in one step (all Engram layers)
    file_gather_rows_s: float = 0.0  # the file tier's all-hit path (cache probe + gather), rows/s; 0: gather_rows_s
    file_call_s: float = 0.0  # fixed cost of the file tier's lookups in one step (all Engram layers)
    cores: int = 0  # cpu kind: what host traffic and the page reads' CPU share
    cpu_speed_ms: float = 0.0  # calibrate's CPU speed probe: the speed its CPU costs were measured at (at_speed)
    # cpu kind, (concurrency, value) pairs measured by calibrate: σ(c), φ(c), its own server's tok/s (naive baseline)
    server_step_curve: tuple[tuple[float, float], ...] = ()
    request_steps_curve: tuple[tuple[float, float], ...] = ()
    serve_tok_s_curve: tuple[tuple[float, float], ...] = ()

    def at_speed(self, speed_ms: float) -> HardwareSpec:
        """This CPU machine at speed probe `speed_ms`: every CPU cost scaled by it over `cpu_speed_ms` (GPU: as is)."""
        if not speed_ms > 0:
            raise ValueError(f"speed_ms must be > 0, got {speed_ms}")
        if self.kind != "cpu" or self.cpu_speed_ms <= 0:
            return self
        k = speed_ms / self.cpu_speed_ms
        times = ("step_overhead_s", "per_seq_s", "per_token_s", "request_overhead_s", "gather_call_s", "file_call_s")
        rates = ("compute_flops", "gather_rows_s", "file_gather_rows_s")
        return replace(self, **{f: getattr(self, f) * k for f in times}, **{f: getattr(self, f) / k for f in rates},
                       disk=replace(self.disk, cpu_s_per_page=self.disk.cpu_s_per_page * k))


@dataclass(frozen=True)
class Placement:
    """Where the tables live: device, host (DRAM), file (NVMe behind a host cache); KV optionally in host DRAM."""

    kind: str
    cache_fraction: float = 0.0  # file: host cache as a fraction of the table
    hit_rate: float | None = None  # file: the cache hit rate; None: from the model's hit-rate curve
    hot_rows: bool = False  # file: the cache starts with the most read rows (the model's hot_hit_rate_curve)
    kv_offload: bool = False  # K/V past the device's room lives in host DRAM, streamed over the link every step

    def __post_init__(self) -> None:
        if self.kind not in ENGRAM_SOURCE:
            raise ValueError(f"unknown placement {self.kind!r} (valid: {', '.join(ENGRAM_SOURCE)})")
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise ValueError(f"cache_fraction must be in [0, 1], got {self.cache_fraction}")
        if self.hit_rate is not None and not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1], got {self.hit_rate}")
        if self.hot_rows and self.kind != "file":
            raise ValueError(f"hot_rows applies to the file placement's cache, not to {self.kind!r}")

    @property
    def label(self) -> str:
        name = self.kind + (f" {self.cache_fraction:.0%} cache" if self.kind == "file" else "")
        name += " + hot rows" if self.hot_rows else ""
        return name + (" + KV offload" if self.kv_offload else "")


@dataclass(frozen=True)
class Workload:
    """The closed loop: c users, each sending its next request when the last one ends."""

    input_len: float  # mean prompt tokens
    output_len: float  # mean output tokens (>= 1)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    max_input_len: int | None = None  # longest prompt (KV sized for it); None: input_len
    max_output_len: int | None = None
    queue_depth: int = 128  # reads in flight the file tier keeps
    host_traffic_bps: float = 0.0  # other traffic through host DRAM (bytes/s moved, e.g. K/V swaps of other jobs)
    prompt_rows_first: bool = False  # the engine's: steps wait only for their decode tokens' misses (c > 1)
    cached_len: float = 0.0  # mean prompt tokens a request finds in the prefix cache (not computed: plan.prefix)
    think_s: float = 0.0  # mean seconds a user waits between its requests (its seat in the batch stays empty)
    kv_host_len: float = 0.0  # of cached_len, the tokens a request's K/V is copied back for from the host K/V tier

    @property
    def computed_len(self) -> float:
        """Mean prompt tokens a request computes: those the prefix cache did not hold."""
        return self.input_len - self.cached_len


@dataclass
class Point:
    """One predicted point: a placement at a concurrency."""

    placement: str
    concurrency: int
    step_s: float
    throughput_tok_s: float  # prompt + output tokens per second
    interactivity: float  # output tokens per second per user (1 / ITL)
    binding: str  # the term that sets the step time
    terms: dict[str, float] = field(default_factory=dict)  # seconds per step of each cost term
    hit_rate: float | None = None
    cycle_s: float = 0.0  # one user's request and think time
    running: float = 0.0  # users whose request is in the engine at a time (c less those thinking)


@dataclass
class Limit:
    """The concurrency where a placement stops, and why."""

    concurrency: int
    binding: str  # "device memory", "host memory", "max_num_seqs"
    device_bytes_per_seq: float


def interpolate(curve: tuple[tuple[float, float], ...], x: float, log_x: bool = False) -> float:
    """Piecewise-linear y(x) through the curve's points (in log x when asked), flat outside them."""
    pts = sorted(curve)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    f = math.log if log_x else float
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            t = 0.0 if x1 == x0 else (f(x) - f(x0)) / (f(x1) - f(x0))
            return y0 + t * (y1 - y0)
    return pts[-1][1]


# ----------------------------------------------------------------------------------------------- memory

def kv_bytes_per_seq(model: ModelSpec, wl: Workload) -> float:
    """K/V bytes one running sequence holds at its end (rounded up to whole blocks), with its fixed state."""
    tokens = math.ceil((wl.max_input_len or wl.input_len) + (wl.max_output_len or wl.output_len))
    blocks = math.ceil(tokens / wl.block_size)
    return blocks * wl.block_size * model.kv_bytes_per_token + model.kv_state_bytes_per_seq


def fixed_memory(model: ModelSpec, placement: Placement) -> tuple[float, float]:
    """(device bytes, host bytes) that do not grow with concurrency: weights, tables, cache, activations."""
    table = model.engram.table_bytes
    device = model.weight_bytes + model.activation_bytes + (table if placement.kind == "device" else 0.0)
    host = table if placement.kind == "host" else placement.cache_fraction * table if placement.kind == "file" else 0
    return device, float(host)


def kv_room(model: ModelSpec, hw: HardwareSpec, placement: Placement) -> tuple[float, float]:
    """(device bytes, host bytes) left for K/V once the fixed bytes are placed (host: 0 without KV offload)."""
    dev_fixed, host_fixed = fixed_memory(model, placement)
    host = max(0.0, hw.host_memory_bytes - host_fixed) if placement.kv_offload else 0.0
    return max(0.0, hw.device_memory_bytes - dev_fixed), host


def concurrency_limit(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement) -> Limit:
    """The most sequences the device budget, host DRAM (K/V offload) and max_num_seqs allow; which of them binds."""
    dev_fixed, host_fixed = fixed_memory(model, placement)
    per_seq = kv_bytes_per_seq(model, wl)
    dev_room, host_room = kv_room(model, hw, placement)
    caps = {"max_num_seqs": wl.max_num_seqs}
    if dev_fixed > hw.device_memory_bytes:
        caps["device memory"] = 0
    if host_fixed > hw.host_memory_bytes:
        caps["host memory"] = 0
    memory = int(dev_room // per_seq) + int(host_room // per_seq)
    caps.setdefault("host memory" if placement.kv_offload else "device memory", memory)
    binding = min(caps, key=lambda k: (caps[k], k != "max_num_seqs"))
    return Limit(caps[binding], binding, per_seq)


# ------------------------------------------------------------------------------------------------- step

def _shared(own: float, other: float) -> float:
    """Finish time of a transfer of `own` seconds sharing a link equally with one of `other` seconds."""
    return own + min(own, other)


def step_terms(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement, c: float
               ) -> tuple[float, dict[str, float], str, float | None]:
    """(step seconds, cost terms in seconds, binding term, hit rate) of a step with c running sequences."""
    context = wl.input_len + max(1.0, wl.output_len) / 2.0  # mean tokens of KV each sequence's attention reads
    tokens = c * (wl.computed_len + max(1.0, wl.output_len) - 1.0) / steps_per_request(wl, c, hw)  # N
    if not (wl.prompt_rows_first and c > 1 and placement.kind == "file"):
        return step_terms_at(model, hw, wl, placement, c, tokens, context)
    waited = tokens * decode_share(wl)  # the prompt tokens' rows were read before their step
    first = step_terms_at(model, hw, wl, placement, c, tokens, context, waited_tokens=waited)
    # W_q: while a waiting prompt's read is in flight (a share rho of the time) the step's own reads take twice as long
    prompt_disk = first[1].get("disk busy", 0.0) * (1.0 - decode_share(wl))
    rho = min(0.95, prompt_disk / first[0]) if first[0] > 0 else 0.0
    hit = first[3] or 0.0
    own = waited * model.engram.rows_per_token * (1.0 - hit) / hw.disk.pages_per_s(wl.queue_depth)
    return step_terms_at(model, hw, wl, placement, c, tokens, context, waited_tokens=waited, queue_s=rho * own)


def decode_share(wl: Workload) -> float:
    """The share of a request's computed tokens that are decode tokens: (L_out - 1) / (L_in + L_out - 1)."""
    lo = max(1.0, wl.output_len)
    return (lo - 1.0) / (wl.computed_len + lo - 1.0)


def placement_hit_rate(model: ModelSpec, placement: Placement) -> float:
    """A file placement's cache hit rate: its own, else the model's curve at its cache size (hot or cold)."""
    if placement.hit_rate is not None:
        return placement.hit_rate
    return model.hit_rate(placement.cache_fraction, placement.hot_rows)


def step_terms_at(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement, c: float, tokens: float,
                  context: float, waited_tokens: float | None = None, queue_s: float = 0.0,
                  decode_tokens: float | None = None) -> tuple[float, dict[str, float], str, float | None]:
    """step_terms for `tokens` tokens over c sequences of `context` tokens, waiting for `waited_tokens` misses."""
    g = model.engram
    rows = tokens * g.rows_per_token
    waited_rows = rows if waited_tokens is None else waited_tokens * g.rows_per_token
    decode = tokens * decode_share(wl) if decode_tokens is None else decode_tokens
    terms: dict[str, float] = {}
    if hw.kind == "cpu":  # compute_flops was fitted to give the calibrated model its measured cost per token
        compute = model.step_flops(tokens, decode) / hw.compute_flops
    else:
        flops = model.step_flops(tokens, decode) / hw.compute_flops
        weights = model.step_weight_bytes(tokens, decode) / hw.device_bw
        kv_read = c * (context * model.kv_bytes_per_token + model.kv_state_bytes_per_seq) / hw.device_bw
        compute = max(flops, weights + kv_read)
    terms["compute"] = compute
    terms["overhead"] = hw.step_overhead_s + c * hw.per_seq_s
    hit = None
    dram_bytes = link_bytes = 0.0
    cpu_fetch = io_wait = waited_cpu = read_cpu = 0.0
    if placement.kind == "host":
        dram_bytes = rows * g.row_bytes
        if hw.kind == "gpu":
            link_bytes = rows * g.row_bytes  # UVA gather: the encoded rows cross the link, dequant on the GPU
        else:
            cpu_fetch = hw.gather_call_s + rows / hw.gather_rows_s
    elif placement.kind == "file":
        hit = placement_hit_rate(model, placement)
        misses = rows * (1.0 - hit)  # one page per missed row: rows never straddle pages; dedup ignored
        waited = waited_rows * (1.0 - hit)
        io_wait = waited / hw.disk.pages_per_s(wl.queue_depth) + (hw.disk.latency_s if waited > 0 else 0.0)
        terms["read queue"] = queue_s
        terms["disk busy"] = misses / hw.disk.pages_per_s(wl.queue_depth)  # every miss, waited for or not
        read_cpu = misses * hw.disk.cpu_s_per_page / hw.disk.threads
        waited_cpu = waited * hw.disk.cpu_s_per_page / hw.disk.threads  # on the reader's thread, before the rows
        dram_bytes = rows * g.row_bytes + misses * hw.disk.page_bytes
        if hw.kind == "gpu":
            link_bytes = rows * g.row_bytes
            cpu_fetch = read_cpu  # the GPU gathers from pinned memory
        else:
            cpu_fetch = rows / (hw.file_gather_rows_s or hw.gather_rows_s) + (hw.file_call_s or hw.gather_call_s)
    kv_link = 0.0
    if placement.kv_offload:  # the sequences past the device's K/V room stream their K/V in every step
        spilled = max(0.0, c - kv_room(model, hw, placement)[0] // kv_bytes_per_seq(model, wl))
        kv_link = spilled * (context * model.kv_bytes_per_token + model.kv_state_bytes_per_seq)
    hide = model.hide_fraction * compute
    host_bw = max(1.0, hw.host_bw - wl.host_traffic_bps)  # what other host-memory traffic leaves
    if hw.kind == "gpu":
        link_s = _shared(link_bytes / hw.link_bw, kv_link / hw.link_bw) if link_bytes else 0.0
        dram_s = _shared(dram_bytes / host_bw, kv_link / host_bw) if dram_bytes else 0.0
        fetch = max(link_s, dram_s, io_wait, cpu_fetch)
        terms["engram fetch"] = fetch
        terms["engram exposed"] = max(0.0, fetch - hide) + queue_s
        terms["kv link"] = kv_link / hw.link_bw if kv_link else 0.0
        step = max(compute + terms["engram exposed"], (link_bytes + kv_link) / hw.link_bw if hw.link_bw else 0.0,
                   (dram_bytes + kv_link) / host_bw, terms.get("disk busy", 0.0)) + terms["overhead"]
    else:
        # σ(c): a server's HTTP loop shares the cores, and other host traffic takes its copying time from them
        stretch = interpolate(hw.server_step_curve, c, log_x=True) if hw.server_step_curve else 1.0
        if wl.host_traffic_bps > 0 and hw.cores > 0:
            steal = min(0.9 * hw.cores, wl.host_traffic_bps / hw.host_bw)
            stretch *= hw.cores / (hw.cores - steal)
        if stretch != 1.0:
            compute, cpu_fetch = compute * stretch, cpu_fetch * stretch
            terms["compute"], terms["overhead"] = compute, terms["overhead"] * stretch
        # the reader threads' CPU runs beside a step that keeps every core busy: spread over the cores, unstretched
        # (measured 0.61x per step against 2-4x added whole); a spec without its cores adds it whole and stretched
        cpu_fetch += read_cpu / hw.cores if hw.cores > 0 else read_cpu * stretch
        # one pool of cores: only waiting on the disk hides, behind compute and the fetch's own CPU work
        terms["engram cpu"] = cpu_fetch
        terms["engram exposed"] = max(0.0, io_wait - hide - cpu_fetch) + queue_s
        # S: the engine's own wait for the rows (the servers' measured stall), not added to the step
        terms["engram wait"] = max(0.0, max(io_wait, waited_cpu) - hide) + queue_s
        step = compute + cpu_fetch + terms["engram exposed"] + terms["overhead"]
        step = max(step, (dram_bytes + kv_link) / host_bw, terms.get("disk busy", 0.0))
    terms = {k: v for k, v in terms.items() if v > 0}
    return step, terms, _binding(terms, placement, step), hit


def _binding(terms: dict[str, float], placement: Placement, step: float) -> str:
    """The cost term that sets the step: the disk if it takes the step, else the largest of backbone, fetch, K/V."""
    if terms.get("disk busy", 0.0) >= step * (1 - 1e-9):
        return "engram (disk)"
    fetch = terms.get("engram exposed", 0.0) + terms.get("engram cpu", 0.0)
    candidates = {"compute": terms.get("compute", 0.0) + terms.get("overhead", 0.0),
                  "kv link": terms.get("kv link", 0.0), ENGRAM_SOURCE[placement.kind]: fetch}
    return max(candidates, key=lambda k: candidates[k])


def steps_per_request(wl: Workload, c: float, hw: HardwareSpec | None = None) -> float:
    """Steps one request spends in the engine: max(L_out, the token budget's), times φ(c) with a CPU `hw`."""
    lo = max(1.0, wl.output_len)
    steps = max(lo, c * (wl.computed_len + lo - 1.0) / wl.max_num_batched_tokens)
    if hw is not None and hw.kind == "cpu" and hw.request_steps_curve:
        steps *= max(1.0, interpolate(hw.request_steps_curve, c, log_x=True))
    return steps


def predict_point(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement, c: int) -> Point:
    """Throughput and interactivity of c closed-loop users (with think time: iterated to a fixed point)."""
    lo = max(1.0, wl.output_len)
    # the host K/V tier's blocks come back over the link (a GPU) or through host memory (a CPU) before their step
    kv_copy = wl.kv_host_len * model.kv_bytes_per_token / (hw.link_bw if hw.kind == "gpu" else hw.host_bw)
    wait = 0.0  # T_wait: with prompt_rows_first a new request waits for its prompt's missed rows before joining
    if placement.kind == "file" and wl.prompt_rows_first and c > 1:
        misses = wl.computed_len * model.engram.rows_per_token * (1.0 - placement_hit_rate(model, placement))
        wait = misses / hw.disk.pages_per_s(wl.queue_depth) + hw.disk.latency_s if misses > 0 else 0.0
    running: float = c
    for _ in range(1 if wl.think_s <= 0 else 30):
        step, terms, binding, hit = step_terms(model, hw, wl, placement, running)
        # the steps that pass while the user is away (seats left empty) count in its cycle, not in its tokens' gaps
        request = steps_per_request(wl, running, hw) * step + hw.request_overhead_s + wait + kv_copy
        cycle = request + wl.think_s
        running = max(1.0, c * request / cycle)
    if wait > 0:
        terms["prompt rows wait"] = wait  # once per request, not per step
    if kv_copy > 0:
        terms["kv host copy"] = kv_copy  # once per request
    throughput = c * (wl.input_len + lo) / cycle
    itl = step * steps_per_request(wl, running) / lo  # one token per step, fewer when prefill chunks fill the budget
    return Point(placement.label, c, step, throughput, 1.0 / itl, binding, terms, hit, cycle, running)


def levels(limit: int, max_concurrency: int) -> list[int]:
    """The concurrencies a `bench serve` sweep runs and the planner predicts: 1, 2, 4, ... ending at the cap."""
    cap = max(1, min(limit, max_concurrency))
    out = [1]
    while out[-1] * 2 <= cap:
        out.append(out[-1] * 2)
    return out if out[-1] == cap else [*out, cap]


@dataclass
class Front:
    """A placement's predicted sweep: its points, its concurrency limit, and its pareto front."""

    placement: Placement
    limit: Limit
    points: list[Point]

    @property
    def pareto(self) -> list[Point]:
        """The points no other point beats on both throughput and interactivity."""
        def beaten(p: Point) -> bool:
            return any(q.throughput_tok_s >= p.throughput_tok_s and q.interactivity >= p.interactivity
                       and (q.throughput_tok_s > p.throughput_tok_s or q.interactivity > p.interactivity)
                       for q in self.points)
        return [p for p in self.points if not beaten(p)]


def predict_front(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement,
                  max_concurrency: int = 1 << 16) -> Front:
    """Every concurrency level up to the placement's limit (or max_concurrency)."""
    limit = concurrency_limit(model, hw, wl, placement)
    cs = levels(limit.concurrency, max_concurrency) if min(limit.concurrency, max_concurrency) >= 1 else []
    return Front(placement, limit, [predict_point(model, hw, wl, placement, c) for c in cs])
