"""`python -m tiergram.bench.gpu`: accelerator gather bandwidth against limits measured in the same run.

Limits: pinned H2D copy and a raw copy of the same random rows through UVA (for UVA gathers), D2D copy (for HBM
cache gathers); measured: the fused gather +
dequant from UVA, resident and HBM-cache tables, the DeviceTable step and end-to-end engine throughput per placement
(docs/accelerator.md). `--device cpu --small` runs the same code as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tiergram.bench.common import HOST_TARGET
from tiergram.format.ids import check_in_range
from tiergram.kernels import RowLayout, pick_backend
from tiergram.kernels.gather import copy_rows_unchecked, launch_unchecked
from tiergram.tiers.device import PinnedHost, resolve_device

UVA_TARGET = 0.8  # UVA gather bandwidth as a fraction of a raw copy of the same rows from the same memory


@dataclass
class GpuBenchConfig:
    """Shapes of the accelerator benchmark; defaults follow DeepSeek-V4.1 (24 heads per layer, D = 256, fp8)."""

    device: str = "cuda"
    table_mib: int = 2048
    heads: int = 24
    positions: int = 8192  # token positions per gather: positions * heads rows
    dim: int = 256
    codec: str = "fp8_e4m3"
    copy_mib: int = 512
    cache_rows: int = 1 << 20
    mixed_hit_rate: float = 0.9
    reps: int = 10
    store_rows: int = 4096  # rows per head of the small table file behind the DeviceTable step
    store_steps: int = 30
    backend: str = "auto"
    model: str | None = None  # end-to-end decode: a trained model (else the default geometry, random weights)
    decode_preset: str = "small"
    decode_requests: int = 16
    decode_prompt: int = 128
    decode_output: int = 64
    decode_reps: int = 2
    seed: int = 0


# tiny shapes (--small): a smoke test of the code paths, not of the hardware
SMALL = {"table_mib": 2, "positions": 32, "copy_mib": 2, "cache_rows": 1024, "reps": 2, "store_rows": 64,
         "store_steps": 2, "decode_preset": "tiny", "decode_requests": 2, "decode_prompt": 12, "decode_output": 4,
         "decode_reps": 1}


def timed(fn: Callable[[], object], dev: torch.device, reps: int, warmup: int = 2) -> float:
    """Best seconds of one fn() call: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_limits(cfg: GpuBenchConfig, dev: torch.device) -> dict[str, float]:
    """GB/s of a pinned host -> device copy and of a device -> device copy (bytes read + written)."""
    n = cfg.copy_mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda").fill_(1)
    a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    h2d = timed(lambda: a.copy_(host, non_blocking=True), dev, cfg.reps)
    d2d = timed(lambda: b.copy_(a), dev, cfg.reps)
    return {"pinned_h2d_GBps": n / h2d / 1e9, "d2d_copy_GBps": 2 * n / d2d / 1e9}


class Region:
    """A synthetic page-structured table (heads of equal rows) in host memory, and ids drawn uniformly from it."""

    def __init__(self, cfg: GpuBenchConfig) -> None:
        rb = cfg.dim + cfg.dim // 32
        self.layout = RowLayout(cfg.codec, cfg.dim, rb, (4096 - 8) // rb, 4096)
        n_pages = max(1, (cfg.table_mib << 20) // 4096)
        per_head = n_pages * self.layout.rows_per_page // cfg.heads
        self.head_rows = np.full(cfg.heads, per_head, dtype=np.int64)
        self.head_offsets = np.arange(cfg.heads, dtype=np.int64) * per_head
        self.data = np.empty(n_pages * 4096, dtype=np.uint8)
        block = np.random.default_rng(cfg.seed).integers(0, 127, 1 << 20, dtype=np.uint8)  # finite codes
        for start in range(0, self.data.size, block.size):
            chunk = self.data[start:start + block.size]
            chunk[:] = block[:chunk.size]
        rng = np.random.default_rng(cfg.seed + 1)
        self.ids = (rng.random((cfg.positions, cfg.heads)) * self.head_rows).astype(np.int64)
        check_in_range(self.ids, self.head_rows)  # validated once: the timed launches below skip the checks

    @property
    def rows(self) -> int:
        return int(self.ids.size)


def gather_sweep(region: Region, data: torch.Tensor, dev: torch.device, cfg: GpuBenchConfig,
                 configs: list[tuple[int, int]], raw: bool = False, **cache) -> dict:
    """Best useful-row bandwidth (GB/s of encoded rows read) over (block_rows, num_warps) configs; `raw`: the rows
    copied undecoded (the limit of the gather's reads), else gathered and decoded to bfloat16."""
    ids = torch.from_numpy(region.ids.reshape(-1)).to(dev)
    offs = torch.from_numpy(region.head_offsets).to(dev)
    if raw:
        out = torch.empty(region.rows * region.layout.row_bytes, dtype=torch.uint8, device=dev)
        launch = copy_rows_unchecked
    else:
        out = torch.empty(region.rows * cfg.dim, dtype=torch.bfloat16, device=dev)
        launch = launch_unchecked
    sweep = []
    for br, nw in configs:
        t = timed(lambda br=br, nw=nw: launch(data, ids, offs, out, region.layout, block_rows=br, num_warps=nw,
                                              backend=cfg.backend, **cache), dev, cfg.reps)
        sweep.append({"block_rows": br, "num_warps": nw, "seconds": t,
                      "GBps": region.rows * region.layout.row_bytes / t / 1e9})
    best = max(sweep, key=lambda s: s["GBps"])
    moved = 2 if raw else 1 + cfg.dim * 2 / region.layout.row_bytes  # bytes read + written, per byte of rows read
    return {"GBps": best["GBps"], "moved_GBps": best["GBps"] * moved,
            "rows_per_s": region.rows / best["seconds"], "best": {k: best[k] for k in ("block_rows", "num_warps")},
            "sweep": sweep}


def cache_args(region: Region, cfg: GpuBenchConfig, dev: torch.device, hit_rate: float) -> dict:
    """An HBM cache of random rows and a per-id slot array with `hit_rate` hits (no fills)."""
    rng = np.random.default_rng(cfg.seed + 2)
    s = min(cfg.cache_rows, int(region.head_rows.sum()))
    cache = torch.randint(0, 127, (s, region.layout.row_bytes), dtype=torch.uint8, device=dev)
    slots = rng.integers(0, s, region.rows)
    slots[rng.random(region.rows) >= hit_rate] = -1
    return {"cache": cache, "slots": torch.from_numpy(slots).to(dev)}


def store_step(cfg: GpuBenchConfig, dev: torch.device, positions: int = 64) -> dict:
    """DeviceTable prefetch + wait per decode step (host tier + HBM cache, Zipf ids) on a small real table file."""
    from tiergram.bench.common import draw_ids
    from tiergram.format import TableManifest, create_table, random_values
    from tiergram.store.device_table import DeviceTable

    rows, steps = cfg.store_rows, cfg.store_steps
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.tgram"
        m = TableManifest(codec=cfg.codec, dim=cfg.dim, head_rows=(rows,) * cfg.heads)
        create_table(path, m, random_values(cfg.dim, seed=cfg.seed), progress=False)
        rng = np.random.default_rng(cfg.seed + 3)
        batches = [draw_ids("zipf", (positions, cfg.heads), np.full(cfg.heads, rows), rng) for _ in range(steps)]
        with DeviceTable(path, device=dev, tier="host", dtype=torch.bfloat16, staging_tokens=positions,
                         cache_bytes=m.total_rows // 4 * m.row_bytes, kernel_backend=cfg.backend) as table:
            table.prefetch(batches[0]).wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for ids in batches:
                table.prefetch(ids).wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t0
            s = table.stats()
    return {"positions": positions, "ms_per_step": dt / steps * 1e3, "hit_rate": s["hit_rate"]}


DECODE_PLACEMENTS = ("device", "host", "file")


def default_model(root: Path, preset_name: str, seed: int) -> Path:
    """The preset's geometry with random weights, saved to root (the GPU machine has no corpus to train on)."""
    from tiergram.model import EngramLM
    from tiergram.model.checkpoint import save_pretrained
    from tiergram.model.config import preset

    torch.manual_seed(seed)
    return save_pretrained(EngramLM(preset(preset_name, 16384)).eval(), root / f"{preset_name}-random")


def decode_throughput(cfg: GpuBenchConfig, dev: torch.device) -> dict:
    """Engine tokens/s of the same requests with the tables resident, in pinned host memory (UVA) and on file
    behind a 10% HBM cache; the model --model / $TIERGRAM_MODEL names, else the preset with random weights."""
    from tiergram.bench.serve import layer_table_bytes
    from tiergram.engine import EngineConfig, LLMEngine, Placement, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        given = cfg.model or os.environ.get("TIERGRAM_MODEL")
        model_dir = given or str(default_model(Path(tmp), cfg.decode_preset, cfg.seed))
        cache_bytes = int(0.1 * min(layer_table_bytes(model_dir)))  # exports the fp8 tables the engine reads
        rng = np.random.default_rng(cfg.seed)
        prompts = [rng.integers(2, 1000, cfg.decode_prompt).tolist() for _ in range(cfg.decode_requests)]
        params = SamplingParams(max_tokens=cfg.decode_output, ignore_eos=True)
        tokens = cfg.decode_requests * (cfg.decode_prompt + cfg.decode_output)
        result: dict = {"model": given or f"{cfg.decode_preset} (random)",
                        "requests": cfg.decode_requests, "prompt": cfg.decode_prompt, "output": cfg.decode_output,
                        "file_cache_bytes": cache_bytes}
        placements = {"device": Placement("device"), "host": Placement("host"),
                      "file": Placement("file", cache_bytes=cache_bytes)}
        for name in DECODE_PLACEMENTS:
            engine_cfg = EngineConfig(model_dir=model_dir, placement=placements[name], device=str(dev),
                                      max_num_seqs=cfg.decode_requests)
            with LLMEngine(engine_cfg) as engine:
                engine.generate(prompts[:2], params)  # warm-up: kernels compiled, caches allocated
                walls = []
                for _ in range(cfg.decode_reps):
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    engine.generate(prompts, params)
                    walls.append(time.perf_counter() - t0)
                m = engine.metrics()
                result[name] = {"tok_s": tokens / min(walls), "walls_s": walls,
                                "exposed_stall_s": m.exposed_stall_s, "cache_hit_rate": m.engram["cache_hit_rate"]}
                # the file tier's read mode in use ('buffered' where O_DIRECT was refused: page cache, not disk)
                modes = {src.stats().get("file_mode") for src in engine.sources.values()} - {None}
                if modes:
                    result[name]["file_mode"] = ",".join(sorted(modes))
    device, host, file = (result[p]["tok_s"] for p in ("device", "host", "file"))
    result.update(host_vs_device=host / device, host_target=HOST_TARGET, host_meets_target=host / device >= HOST_TARGET,
                  file_vs_host=file / host)
    return result


def run(cfg: GpuBenchConfig, progress: Callable[[dict], object] | None = None) -> dict:
    """Every measurement (GB/s, ratios to the limits); one that raises is reported as {"error": ...} and the others
    still run; `progress(report)` after each, so a run stopped part way keeps what it measured."""
    dev = resolve_device(cfg.device)
    report: dict = {"config": asdict(cfg), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "backend": pick_backend(dev, cfg.backend), "torch": torch.__version__, "errors": {}}

    def section(key: str, fn: Callable[[], dict], merge: bool = False) -> dict | None:
        try:
            result = fn()
        except Exception as e:  # a benchmark reports what it could not measure and goes on
            report["errors"][key] = f"{type(e).__name__}: {e}"
            report[key] = {"error": report["errors"][key]}
            result = None
        else:
            if merge:
                report.update(result)
            else:
                report[key] = result
        if progress is not None:
            progress(report)
        return result

    def per(value: float, limit: str) -> float | None:
        return value / report[limit] if report.get(limit) else None

    section("copy_limits", lambda: copy_limits(cfg, dev), merge=True)
    region = Region(cfg)
    report["table_bytes"] = int(region.data.nbytes)
    configs = [(br, nw) for br in (4, 8, 16, 32) for nw in (4, 8)] if dev.type == "cuda" else [(8, 4)]

    def device_gather() -> dict:
        g = gather_sweep(region, torch.from_numpy(region.data).to(dev), dev, cfg, configs)
        return {**g, "moved_ratio_to_d2d": per(g["moved_GBps"], "d2d_copy_GBps")}

    section("device_gather", device_gather)
    try:
        pinned = PinnedHost(region.data, dev)
    except Exception as e:  # no UVA figures; the rest still runs
        why = f"registering the table failed: {type(e).__name__}: {e}"
        for key in ("uva_row_copy", "uva_gather", "hbm_cache_gather", "hbm_cache_mixed"):
            report["errors"][key] = why
            report[key] = {"error": why}
        pinned = None
    if pinned is not None:
        host = pinned.tensor
        try:
            def uva_row_copy() -> dict:
                g = gather_sweep(region, host, dev, cfg, configs, raw=True)
                return {**g, "ratio_to_pinned_h2d": per(g["GBps"], "pinned_h2d_GBps")}

            def uva_gather() -> dict:
                g = gather_sweep(region, host, dev, cfg, configs)
                r = g["GBps"] / row_copy["GBps"] if row_copy else None
                return {**g, "ratio_to_pinned_h2d": per(g["GBps"], "pinned_h2d_GBps"), "ratio_to_row_copy": r,
                        "target": UVA_TARGET, "meets_target": r is not None and r >= UVA_TARGET}

            def cache_gather(hit_rate: float) -> dict:
                g = gather_sweep(region, host, dev, cfg, configs, **cache_args(region, cfg, dev, hit_rate))
                return {**g, "moved_ratio_to_d2d": per(g["moved_GBps"], "d2d_copy_GBps")}

            def mixed_gather() -> dict:
                g = cache_gather(cfg.mixed_hit_rate)
                return {**g, "hit_rate": cfg.mixed_hit_rate, "speedup_vs_uva": g["GBps"] / uva["GBps"] if uva else None}

            row_copy = section("uva_row_copy", uva_row_copy)
            uva = section("uva_gather", uva_gather)
            section("hbm_cache_gather", lambda: cache_gather(1.0))
            section("hbm_cache_mixed", mixed_gather)
        finally:
            pinned.close()
    section("store_step", lambda: store_step(cfg, dev))
    section("decode", lambda: decode_throughput(cfg, dev))
    return report


def default_out() -> Path:
    """$OUT/gpu_check.json when $OUT is set, else build/gpu_check.json."""
    return Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("build") / "gpu_check.json"


def summary(r: dict) -> str:
    """A few human lines."""
    lines = [f"device {r['device']} ({r['backend']}): pinned H2D {r.get('pinned_h2d_GBps', float('nan')):.1f} GB/s, "
             f"D2D {r.get('d2d_copy_GBps', float('nan')):.1f} GB/s"]
    for key in ("uva_row_copy", "uva_gather", "device_gather", "hbm_cache_gather", "hbm_cache_mixed"):
        g = r.get(key, {"error": "not measured"})
        if "error" in g:
            lines.append(f"{key}: {g['error']}")
            continue
        extra = f", {g['ratio_to_pinned_h2d']:.0%} of pinned H2D" if g.get("ratio_to_pinned_h2d") is not None else ""
        if g.get("ratio_to_row_copy") is not None:
            extra += f", {g['ratio_to_row_copy']:.0%} of the raw row copy (target {UVA_TARGET:.0%})"
        lines.append(f"{key}: {g['GBps']:.1f} GB/s of rows, {g['rows_per_s'] / 1e6:.1f} M rows/s{extra}")
    st = r.get("store_step", {"error": "not measured"})
    lines.append(f"store step: {st['error']}" if "error" in st else
                 f"store step: {st['ms_per_step']:.2f} ms per {st['positions']} positions")
    d = r.get("decode", {"error": "not measured"})
    if "error" in d:
        lines.append(f"decode: {d['error']}")
    else:
        lines.append(f"decode ({d['model']}, {d['requests']} x {d['prompt']}+{d['output']} tokens): "
                     + ", ".join(f"{p} {d[p]['tok_s']:.0f} tok/s" for p in DECODE_PLACEMENTS)
                     + f"; host/resident {d['host_vs_device']:.3f} (target {HOST_TARGET:.0%}), "
                       f"file/host {d['file_vs_host']:.3f} (file reads {d['file'].get('file_mode', 'mode unknown')})")
    if r.get("errors"):
        lines.append(f"errors: {r['errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiergram.bench.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON (else a summary)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes: a smoke test of the code paths")
    p.add_argument("--model", default=None, help="trained model directory for end-to-end decode throughput")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"))
    p.add_argument("--out", type=Path, default=None, help="JSON file (default $OUT/gpu_check.json or build/...)")
    p.add_argument("--note", action="append", default=[], metavar="KEY=VALUE", help="extra field for the report")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu --small for a smoke test)", file=sys.stderr)
        return 2
    cfg = GpuBenchConfig(device=a.device, model=a.model, backend=a.backend, **(SMALL if a.small else {}))
    notes = dict(n.split("=", 1) for n in a.note if "=" in n)
    out = a.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(report: dict) -> None:  # after every measurement: a run killed part way keeps the figures so far
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({**report, "notes": notes}, indent=2, default=str) + "\n")
        tmp.replace(out)

    report = run(cfg, progress=write)
    report["notes"] = notes
    write(report)
    print(json.dumps(report, indent=2, default=str) if a.json else summary(report))
    print(f"written to {out}", file=sys.stderr)
    if report["errors"]:
        print(f"measurements that failed: {', '.join(report['errors'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
