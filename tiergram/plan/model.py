"""The step model of the planner: what one serving step costs per placement, and what caps concurrency.

Plain dataclasses and functions, no I/O: `predict_point` turns a model, a machine, a placement and a workload
into one predicted point (throughput, interactivity, the step's cost terms, what binds). The equations are in
docs/planner.md; every name here follows them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

PLACEMENT_KINDS = ("device", "host", "file")


@dataclass(frozen=True)
class EngramGeometry:
    """The Engram tables: which blocks read them, rows per token, bytes per row, rows per table."""

    layers: tuple[int, ...]  # block indices (0-based) with an Engram layer
    heads: int  # rows each token reads per Engram layer (all n-gram orders together)
    row_bytes: int  # one encoded row on disk / in memory
    rows_per_layer: int | tuple[int, ...]  # rows of one layer's table, or one count per layer in `layers` order
    dim: int  # values per row once dequantized
    out_bytes: int = 4  # bytes per dequantized value handed to the layer (fp32 on a CPU, bf16 on a GPU)

    @property
    def rows_per_token(self) -> int:
        return len(self.layers) * self.heads

    @property
    def table_rows(self) -> int:
        """Rows of all layers' tables."""
        rows = self.rows_per_layer
        return sum(rows) if isinstance(rows, tuple) else len(self.layers) * rows

    @property
    def table_bytes(self) -> int:
        """All layers' tables, encoded."""
        return self.table_rows * self.row_bytes


@dataclass(frozen=True)
class MoeGeometry:
    """Routed experts, for the weight bytes a step reads: each token picks `experts_per_token` of `experts` in
    each of `layers` blocks, and a step reads every distinct expert its tokens picked once."""

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
    # the same with the cache preloaded at start with the rows a corpus reads most (the engine's --hot-rows)
    hot_hit_rate_curve: tuple[tuple[float, float], ...] = ()
    # parameters a prompt token multiplies when prefill runs fewer blocks than decode (a causal encoder-decoder
    # runs only its encoder for the prompt); 0: active_params
    prefill_active_params: float = 0.0
    # K/V bytes every running sequence holds whatever its length (sliding-window attention's last tokens)
    kv_state_bytes_per_seq: float = 0.0
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
        """Weight bytes a step reads: dense min(W, N·W_act); MoE the non-expert weights plus each block's
        distinct experts (prompt tokens only in the blocks prefill runs)."""
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
        """Hit rate of a host cache holding `cache_fraction` of the table (log-linear in the measured curve); with
        `hot_rows`, of one preloaded with the most read rows (ValueError when the spec has no such curve)."""
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
    # a cache under the drives (a VM volume's host cache, a SAN's): pages/s at queue depth 128 for pages it holds,
    # which a workload's re-reads may find there (0: none)
    cache_pages_per_s: float = 0.0

    @property
    def latency_s(self) -> float:
        """One read's latency: the inverse of a drive's rate at queue depth 1."""
        return 1.0 / interpolate(self.iops_curve, 1.0)

    def pages_per_s(self, queue_depth: float) -> float:
        """Pages/s of all drives with `queue_depth` reads in flight, spread evenly over the drives."""
        return self.drives * interpolate(self.iops_curve, max(1.0, queue_depth / self.drives), log_x=True)

    def at_limit(self, pages_per_s: float, queue_depth: float) -> DiskSpec:
        """These drives with every point of the curve scaled so that `queue_depth` gives `pages_per_s` (the same
        curve's shape at a measured level)."""
        k = pages_per_s / self.pages_per_s(queue_depth)
        return replace(self, iops_curve=tuple((q, r * k) for q, r in self.iops_curve))

    def with_rereads(self, reread_share: float) -> DiskSpec:
        """These drives for a workload whose page reads are `reread_share` re-reads, which the cache under the drives
        serves at its rate (the curve's shape at its level) and the rest at the drives': each queue depth's time
        per page is the reads' mix of the two. Unchanged without a cache, or where it is no faster."""
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
    device_gather_rows_s: float = 0.0  # gather from a device-resident table, rows/s (0: free against compute)
    gather_call_s: float = 0.0  # fixed cost of the host tier's lookups in one step (all Engram layers)
    file_gather_rows_s: float = 0.0  # the file tier's all-hit path (cache probe + gather), rows/s; 0: gather_rows_s
    file_call_s: float = 0.0  # fixed cost of the file tier's lookups in one step (all Engram layers)
    # CPU cores (cpu kind: what other host-memory traffic steals its copying time from, and what the page reads'
    # CPU spreads over beside a step's compute)
    cores: int = 0
    cpu_speed_ms: float = 0.0  # calibrate's CPU speed probe: the speed its CPU costs were measured at (at_speed)
    # cpu kind: a server's step over the engine's alone, (concurrency, factor) pairs, measured by calibrate
    server_step_curve: tuple[tuple[float, float], ...] = ()
    # cpu kind: the steps a request lives through in a server over the steps it needs, (concurrency, factor) pairs,
    # measured by calibrate: while one user is between requests (its last token streamed, the next not yet admitted)
    # the others' steps run with a seat empty
    request_steps_curve: tuple[tuple[float, float], ...] = ()
    # cpu kind: the throughput calibrate's own host server reached at each concurrency, (concurrency, tok/s) pairs:
    # the naive baseline `plan validate --naive` sets beside the step model
    serve_tok_s_curve: tuple[tuple[float, float], ...] = ()

    def at_speed(self, speed_ms: float) -> HardwareSpec:
        """This CPU machine while its speed probe (`machine.cpu_speed_ms`) reads `speed_ms` instead of the
        calibration's `cpu_speed_ms`: every CPU cost scaled by their ratio (times up, rates down), memory, link and
        the disk's page rates unchanged. A shared VM's speed drifts by tens of percent within minutes; a sweep
        that probed it beside its rounds is predicted at its probes' median. A GPU machine is returned as it is."""
        if not speed_ms > 0:
            raise ValueError(f"speed_ms must be > 0, got {speed_ms}")
        if self.kind != "cpu" or self.cpu_speed_ms <= 0:
            return self
        k = speed_ms / self.cpu_speed_ms
        return replace(self, compute_flops=self.compute_flops / k, step_overhead_s=self.step_overhead_s * k,
                       per_seq_s=self.per_seq_s * k, gather_rows_s=self.gather_rows_s / k,
                       per_token_s=self.per_token_s * k, request_overhead_s=self.request_overhead_s * k,
                       device_gather_rows_s=self.device_gather_rows_s / k, gather_call_s=self.gather_call_s * k,
                       file_gather_rows_s=self.file_gather_rows_s / k, file_call_s=self.file_call_s * k,
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
        if self.kind not in PLACEMENT_KINDS:
            raise ValueError(f"unknown placement {self.kind!r} (valid: {', '.join(PLACEMENT_KINDS)})")
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
    host_reserve_bytes: float = 0.0  # host DRAM the planner must leave alone (OS, other processes)
    host_traffic_bps: float = 0.0  # other traffic through host DRAM (bytes/s moved, e.g. K/V swaps of other jobs)
    # the engine's prompt_rows_first: while others decode, a new prompt's rows are read before it joins the batch,
    # so a step waits only for its decode tokens' misses (the prompt's are read beside the steps and delay only
    # that request); alone (c = 1) a prompt starts at once and its step waits for its rows
    prompt_rows_first: bool = False
    cached_len: float = 0.0  # mean prompt tokens a request finds in the prefix cache (not computed: plan.prefix)
    think_s: float = 0.0  # mean seconds a user waits between its requests (its seat in the batch stays empty)
    kv_host_len: float = 0.0  # of cached_len, the tokens a request's K/V is copied back for from the host K/V tier

    @property
    def computed_len(self) -> float:
        """Mean prompt tokens a request computes: those the prefix cache did not hold."""
        return self.input_len - self.cached_len

    @property
    def seq_tokens(self) -> int:
        """The KV tokens one sequence holds at its end."""
        return int(math.ceil((self.max_input_len or self.input_len) + (self.max_output_len or self.output_len)))


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
    host_bytes_per_seq: float


def interpolate(curve: tuple[tuple[float, float], ...], x: float, log_x: bool = False) -> float:
    """Piecewise-linear y(x) through the curve's points (in log x when asked), flat outside them."""
    if not curve:
        raise ValueError("an empty curve cannot be interpolated")
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
    blocks = math.ceil(wl.seq_tokens / wl.block_size)
    return blocks * wl.block_size * model.kv_bytes_per_token + model.kv_state_bytes_per_seq


def fixed_memory(model: ModelSpec, placement: Placement) -> tuple[float, float]:
    """(device bytes, host bytes) that do not grow with concurrency: weights, tables, cache, activations."""
    table = model.engram.table_bytes
    device = model.weight_bytes + model.activation_bytes + (table if placement.kind == "device" else 0.0)
    host = table if placement.kind == "host" else placement.cache_fraction * table if placement.kind == "file" else 0
    return device, float(host)


def kv_room(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement) -> tuple[float, float]:
    """(device bytes, host bytes) left for K/V once the fixed bytes are placed (host: 0 without KV offload)."""
    dev_fixed, host_fixed = fixed_memory(model, placement)
    dev = max(0.0, hw.device_memory_bytes - dev_fixed)
    host = max(0.0, hw.host_memory_bytes - wl.host_reserve_bytes - host_fixed) if placement.kv_offload else 0.0
    return dev, host


def concurrency_limit(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement) -> Limit:
    """The most sequences the device budget, host DRAM and max_num_seqs allow; which of them binds.

    With KV offload, sequences whose K/V does not fit the device room live in host DRAM (streamed each step).
    """
    dev_fixed, host_fixed = fixed_memory(model, placement)
    per_seq = kv_bytes_per_seq(model, wl)
    dev_room, host_room = kv_room(model, hw, wl, placement)
    caps = {"max_num_seqs": wl.max_num_seqs}
    if dev_fixed > hw.device_memory_bytes:
        caps["device memory"] = 0
    if host_fixed > hw.host_memory_bytes - wl.host_reserve_bytes:
        caps["host memory"] = 0
    memory = int(dev_room // per_seq) + int(host_room // per_seq)
    caps.setdefault("host memory" if placement.kv_offload else "device memory", memory)
    binding = min(caps, key=lambda k: (caps[k], k != "max_num_seqs"))
    return Limit(caps[binding], binding, per_seq, per_seq if placement.kv_offload else 0.0)


# ------------------------------------------------------------------------------------------------- step

def _shared(own: float, other: float) -> float:
    """Finish time of a transfer of `own` seconds sharing a link equally with one of `other` seconds."""
    return own + min(own, other)


def step_terms(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement, c: float
               ) -> tuple[float, dict[str, float], str, float | None]:
    """(step seconds, cost terms in seconds, binding term, hit rate) of a step with c running sequences."""
    context = wl.input_len + max(1.0, wl.output_len) / 2.0  # mean tokens of KV each sequence's attention reads
    tokens = tokens_per_step(wl, c, hw)
    if not (wl.prompt_rows_first and c > 1 and placement.kind == "file"):
        return step_terms_at(model, hw, wl, placement, c, tokens, context)
    waited = tokens * decode_share(wl)  # the prompt tokens' rows were read before their step
    first = step_terms_at(model, hw, wl, placement, c, tokens, context, waited_tokens=waited)
    # A step's prefetch and the prompt reads of the requests waiting to join run side by side (each on its own
    # queue and io_uring ring): while a prompt read is in flight, a share rho of the time, the disk interleaves
    # the two, and the step's own reads take about twice as long -- rho * (their own read time) more.
    prompt_disk = first[1].get("disk busy", 0.0) * (1.0 - decode_share(wl))
    rho = min(0.95, prompt_disk / first[0]) if first[0] > 0 else 0.0
    hit = first[3] or 0.0
    own = waited * model.engram.rows_per_token * (1.0 - hit) / hw.disk.pages_per_s(wl.queue_depth)
    return step_terms_at(model, hw, wl, placement, c, tokens, context, waited_tokens=waited, queue_s=rho * own)


def decode_share(wl: Workload) -> float:
    """The share of a request's computed tokens that are decode tokens: (L_out - 1) / (L_in + L_out - 1), L_in the
    prompt tokens it computes (those the prefix cache did not hold)."""
    lo = max(1.0, wl.output_len)
    return (lo - 1.0) / (wl.computed_len + lo - 1.0)


def prompt_wait_s(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement, c: int) -> float:
    """Seconds a new request waits for its prompt's missed rows before joining (prompt_rows_first, c > 1, file)."""
    if placement.kind != "file" or not wl.prompt_rows_first or c <= 1:
        return 0.0
    return prompt_read_s(model, hw, wl, placement)


def placement_hit_rate(model: ModelSpec, placement: Placement) -> float:
    """A file placement's cache hit rate: its own, else the model's curve at its cache size (hot or cold)."""
    if placement.hit_rate is not None:
        return placement.hit_rate
    return model.hit_rate(placement.cache_fraction, placement.hot_rows)


def prompt_read_s(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement) -> float:
    """Seconds to read a prompt's missed rows at the queue depth, plus one read's latency (a file placement)."""
    hit = placement_hit_rate(model, placement)
    misses = wl.computed_len * model.engram.rows_per_token * (1.0 - hit)
    return misses / hw.disk.pages_per_s(wl.queue_depth) + hw.disk.latency_s if misses > 0 else 0.0


def step_terms_at(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement, c: float, tokens: float,
                  context: float, waited_tokens: float | None = None, queue_s: float = 0.0,
                  decode_tokens: float | None = None) -> tuple[float, dict[str, float], str, float | None]:
    """step_terms for a step of `tokens` tokens over c sequences of `context` tokens each (a decode step: c).

    `waited_tokens`: the tokens whose missed rows the step waits for (None: all; with prompt_rows_first, the
    decode tokens); the rest are read beside the step: they load the disk and the reader's CPU, not the wait.
    `queue_s`: time the step's reads wait in the read queue behind other reads before their own start.
    `decode_tokens`: the step's decode tokens (None: the workload's decode share of `tokens`); the rest are
    prompt tokens, which cost the model's prefill FLOPs."""
    g = model.engram
    rows = tokens * g.rows_per_token
    waited_rows = rows if waited_tokens is None else waited_tokens * g.rows_per_token
    decode = tokens * decode_share(wl) if decode_tokens is None else decode_tokens
    terms: dict[str, float] = {}
    # backbone compute
    if hw.kind == "cpu":
        # calibrate measured seconds per token on one model and wrote compute_flops = its FLOPs per token / that:
        # the same model gets back exactly the measured cost, another model its FLOPs' share of it
        compute = model.step_flops(tokens, decode) / hw.compute_flops
    else:
        flops = model.step_flops(tokens, decode) / hw.compute_flops
        weights = model.step_weight_bytes(tokens, decode) / hw.device_bw
        # offloaded K/V is copied in, then read; every sequence also reads its fixed (sliding-window) state
        kv_read = c * (context * model.kv_bytes_per_token + model.kv_state_bytes_per_seq) / hw.device_bw
        compute = max(flops, weights + kv_read)
    terms["compute"] = compute
    terms["overhead"] = hw.step_overhead_s + c * hw.per_seq_s
    # Engram rows: where they come from
    hit = None
    dram_bytes = link_bytes = 0.0
    cpu_fetch = io_wait = waited_cpu = read_cpu = 0.0
    if placement.kind == "device":
        if hw.device_gather_rows_s > 0:
            terms["engram gather"] = rows / hw.device_gather_rows_s
    elif placement.kind == "host":
        dram_bytes = rows * g.row_bytes
        if hw.kind == "gpu":
            link_bytes = rows * g.row_bytes  # UVA gather: the encoded rows cross the link, dequant on the GPU
        else:
            cpu_fetch = hw.gather_call_s + rows / hw.gather_rows_s
    else:
        hit = placement_hit_rate(model, placement)
        misses = rows * (1.0 - hit)  # one page per missed row: rows never straddle pages; dedup ignored
        waited = waited_rows * (1.0 - hit)
        # the reads pipeline at the queue depth; the first one still waits a whole read's latency (1 / QD1 rate)
        io_wait = waited / hw.disk.pages_per_s(wl.queue_depth) + (hw.disk.latency_s if waited > 0 else 0.0)
        if queue_s > 0:
            terms["read queue"] = queue_s
        disk_s = misses / hw.disk.pages_per_s(wl.queue_depth)  # every miss, waited for or not, is a disk read
        if disk_s > 0:
            terms["disk busy"] = disk_s
        gather = rows / (hw.file_gather_rows_s or hw.gather_rows_s) + (hw.file_call_s or hw.gather_call_s)
        read_cpu = misses * hw.disk.cpu_s_per_page / hw.disk.threads  # the reader threads' CPU for the step's pages
        cpu_fetch = gather
        # the waited reads' own CPU (submit, complete, verify) runs on the reader's thread before the rows are in
        waited_cpu = waited * hw.disk.cpu_s_per_page / hw.disk.threads
        dram_bytes = rows * g.row_bytes + misses * hw.disk.page_bytes
        if hw.kind == "gpu":
            link_bytes = rows * g.row_bytes
            cpu_fetch = misses * hw.disk.cpu_s_per_page / hw.disk.threads  # the GPU gathers from pinned memory
    kv_link = 0.0
    if placement.kv_offload:  # the sequences past the device's K/V room stream their K/V in every step
        dev_room = kv_room(model, hw, wl, placement)[0]
        spilled = max(0.0, c - dev_room // kv_bytes_per_seq(model, wl))
        kv_link = spilled * (context * model.kv_bytes_per_token + model.kv_state_bytes_per_seq)
    kv_dram = kv_link
    hide = model.hide_fraction * compute
    if hw.kind == "gpu":
        link_s = _shared(link_bytes / hw.link_bw, kv_link / hw.link_bw) if link_bytes else 0.0
        host_bw = max(1.0, hw.host_bw - wl.host_traffic_bps)  # what other host-memory traffic leaves
        dram_s = _shared(dram_bytes / host_bw, kv_dram / host_bw) if dram_bytes else 0.0
        fetch = max(link_s, dram_s, io_wait, cpu_fetch)
        terms["engram fetch"] = fetch
        terms["engram exposed"] = max(0.0, fetch - hide) + queue_s
        terms["kv link"] = kv_link / hw.link_bw if kv_link else 0.0
        step = max(compute + terms["engram exposed"], (link_bytes + kv_link) / hw.link_bw if hw.link_bw else 0.0,
                   (dram_bytes + kv_dram) / host_bw, terms.get("disk busy", 0.0)) + terms["overhead"]
    else:
        # a server's steps run beside its HTTP loop (and the load's clients) on the same cores: measured against
        # the engine alone, they take longer from two users on (torch's threads preempted mid-op)
        stretch = interpolate(hw.server_step_curve, c, log_x=True) if hw.server_step_curve else 1.0
        if wl.host_traffic_bps > 0 and hw.cores > 0:
            # other traffic through host memory is copied by these cores: at host_bw per core it takes
            # traffic / host_bw of a core, and everything the cores do in a step stretches by what is left
            steal = min(0.9 * hw.cores, wl.host_traffic_bps / hw.host_bw)
            stretch *= hw.cores / (hw.cores - steal)
        if stretch != 1.0:
            compute, cpu_fetch = compute * stretch, cpu_fetch * stretch
            terms["compute"], terms["overhead"] = compute, terms["overhead"] * stretch
        # the page reads run on threads of their own beside a step whose compute keeps every core busy: the step
        # loses their CPU time spread over the cores, unstretched (measured: a file server's step over host's in
        # the same rounds grew by 0.61x its read threads' CPU per step, median of 30 points, where added whole and
        # stretched they were charged 2-4x that); a spec without its core count adds it whole and stretched
        cpu_fetch += read_cpu / hw.cores if hw.cores > 0 else read_cpu * stretch
        # one pool of cores: fetch CPU time adds to the step; only waiting on the disk can hide behind compute
        # (and behind the fetch's own CPU work); time queued behind other reads hides behind nothing
        terms["engram cpu"] = cpu_fetch
        terms["engram exposed"] = max(0.0, io_wait - hide - cpu_fetch) + queue_s
        # what the engine itself waits for the rows (the servers' measured stall): the waited reads -- or their
        # own CPU on the reader's thread, when that is longer -- less only the layers in front; the fetch CPU it
        # overlaps is already in the step above, so this is not added to it again
        terms["engram wait"] = max(0.0, max(io_wait, waited_cpu) - hide) + queue_s
        step = compute + cpu_fetch + terms["engram exposed"] + terms["overhead"] + terms.get("engram gather", 0.0)
        dram_s = (dram_bytes + kv_dram) / max(1.0, hw.host_bw - wl.host_traffic_bps)
        step = max(step, dram_s, terms.get("disk busy", 0.0))
    terms = {k: v for k, v in terms.items() if v > 0}
    binding = _binding(terms, placement, step)
    return step, terms, binding, hit


def _binding(terms: dict[str, float], placement: Placement, step: float) -> str:
    """The cost term that sets the step: compute (with its fixed overhead) against the exposed fetch and KV (or
    the disk, when reading every miss takes the whole step)."""
    if terms.get("disk busy", 0.0) >= step * (1 - 1e-9):
        return "engram (disk)"
    backbone = terms.get("compute", 0.0) + terms.get("overhead", 0.0)
    fetch = terms.get("engram exposed", 0.0) + terms.get("engram cpu", 0.0)
    candidates = {"compute": backbone, "kv link": terms.get("kv link", 0.0)}
    source = {"device": "engram (device)", "host": "engram (host DRAM)", "file": "engram (disk)"}[placement.kind]
    candidates[source] = fetch
    return max(candidates, key=lambda k: candidates[k])


def steps_per_request(wl: Workload, c: float, hw: HardwareSpec | None = None) -> float:
    """Steps one request spends in the engine: its prefill plus L_out - 1 decodes, or more when the step token
    budget cannot take every prompt and decode of a round at once; with `hw`, times its `request_steps_curve` at c
    (the steps that run with this user's seat empty while it is between requests)."""
    lo = max(1.0, wl.output_len)
    steps = max(lo, c * (wl.computed_len + lo - 1.0) / wl.max_num_batched_tokens)
    if hw is not None and hw.kind == "cpu" and hw.request_steps_curve:
        steps *= max(1.0, interpolate(hw.request_steps_curve, c, log_x=True))
    return steps


def tokens_per_step(wl: Workload, c: float, hw: HardwareSpec | None = None) -> float:
    """Mean tokens one step computes with c closed-loop users: each request's tokens spread over its steps."""
    return c * (wl.computed_len + max(1.0, wl.output_len) - 1.0) / steps_per_request(wl, c, hw)


def predict_point(model: ModelSpec, hw: HardwareSpec, wl: Workload, placement: Placement, c: int) -> Point:
    """Throughput and interactivity of c closed-loop users: each request costs L_out steps of the users running.

    With think time, a user's seat is empty while it thinks: the steps run `running` = c x request / cycle
    sequences, found by iterating (the step's time depends on the batch, the share of the cycle on the step)."""
    if c < 1:
        raise ValueError(f"concurrency must be >= 1, got {c}")
    lo = max(1.0, wl.output_len)
    # the host K/V tier's blocks come back over the link (a GPU) or through host memory (a CPU) before their step
    kv_copy = wl.kv_host_len * model.kv_bytes_per_token / (hw.link_bw if hw.kind == "gpu" else hw.host_bw)
    running: float = c
    for _ in range(1 if wl.think_s <= 0 else 30):
        step, terms, binding, hit = step_terms(model, hw, wl, placement, running)
        wait = prompt_wait_s(model, hw, wl, placement, c)
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
    """The concurrencies a `bench serve` sweep runs and the planner predicts: 1, 2, 4, ... up to min(limit,
    max_concurrency), ending at that cap (at least [1])."""
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
