"""`tiergram plan studies`: the planner's predictions beyond this machine, with their plots (docs/planner.md,
"Studies"). Every number here is a PREDICTION from the specs' figures and stated assumptions."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.plan.model import (
    Front,
    HardwareSpec,
    ModelSpec,
    Placement,
    Workload,
    concurrency_limit,
    predict_front,
    predict_point,
    step_terms_at,
)
from tiergram.plan.predict import label_axes
from tiergram.plan.prefix import Conversations
from tiergram.plan.split import Split, best_splits, conversations_workload, predict_conversations
from tiergram.plots import save_figure, subplots

QD_PER_DRIVE, READER_THREADS_PER_DRIVE = 128, 4
WORKLOADS = {"8K/1K": (8192, 1024), "1K/8K": (1024, 8192), "128K/4K": (131072, 4096)}


def envelope(front: Front, grid: np.ndarray) -> np.ndarray:
    """Best throughput a front reaches at interactivity >= each grid value (nan where it never does)."""
    return np.array([max((p.throughput_tok_s for p in front.points if p.interactivity >= x), default=np.nan)
                     for x in grid])


def _workload(name: str) -> Workload:
    i, o = WORKLOADS[name]
    return Workload(input_len=i, output_len=o, max_num_seqs=4096, max_num_batched_tokens=16384)


def offload_vs_resident(model: ModelSpec, hws: dict[str, HardwareSpec]) -> dict[str, Any]:
    """(1) host / device throughput at equal interactivity over the device front, per machine and workload."""
    out: dict[str, Any] = {}
    for hname, hw in hws.items():
        for wname in WORKLOADS:
            wl = _workload(wname)
            dev = predict_front(model, hw, wl, Placement("device"))
            host = predict_front(model, hw, wl, Placement("host"))
            xs = [p.interactivity for f in (dev, host) for p in f.points]
            grid = np.geomspace(min(xs), max(xs), 200)
            ratio = envelope(host, grid) / envelope(dev, grid)
            ratio = ratio[~np.isnan(ratio)]
            out[f"{hname} {wname}"] = {
                "device_limit": dev.limit.concurrency, "device_binding": dev.limit.binding,
                "host_limit": host.limit.concurrency, "host_binding": host.limit.binding,
                "share_host_better": float((ratio > 1.01).mean()), "median_ratio": float(np.median(ratio)),
                "max_ratio": float(ratio.max()), "fronts": (dev, host)}
    return out


def ssd_vs_dram(model: ModelSpec, hws: dict[str, HardwareSpec], drives: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                fractions: tuple[float, ...] = (0.01, 0.1), workload: str = "8K/1K") -> dict[str, Any]:
    """(2) file / host best throughput (= tokens per dollar) by {(machine, cache label, drives)}."""
    wl = _workload(workload)
    out: dict[str, Any] = {}
    caches = [(f"{f:.0%}", f, False) for f in fractions]
    if model.hot_hit_rate_curve:
        caches += [(f"{f:.0%} + hot rows", f, True) for f in fractions]
    for hname, hw in hws.items():
        host = predict_front(model, hw, wl, Placement("host"))
        for label, f, hot in caches:
            for d in drives:
                # assumed: 128 reads in flight and 4 reader threads per drive (32 of 112 host cores for 8 drives)
                hw_d = replace(hw, disk=replace(hw.disk, drives=d, threads=READER_THREADS_PER_DRIVE * d))
                fr = predict_front(model, hw_d, replace(wl, queue_depth=QD_PER_DRIVE * d),
                                   Placement("file", cache_fraction=f, hot_rows=hot))
                best = max(p.throughput_tok_s for p in fr.points) / max(p.throughput_tok_s for p in host.points)
                out[(hname, label, d)] = {"max_tok_s_ratio": best,
                                          "binding_at_max": max(fr.points, key=lambda p: p.throughput_tok_s).binding}
    return out


def contention(model: ModelSpec, hws: dict[str, HardwareSpec], workload: tuple[int, int] = (131072, 4096)
               ) -> dict[str, Any]:
    """(3) K/V offloaded to host DRAM, with the tables in HBM or sharing host DRAM and the link."""
    wl = Workload(input_len=workload[0], output_len=workload[1], max_num_seqs=1 << 14, max_num_batched_tokens=16384)
    out: dict[str, Any] = {}
    for hname, hw in hws.items():
        for pl in (Placement("device"), Placement("host"), Placement("device", kv_offload=True),
                   Placement("host", kv_offload=True)):
            limit = concurrency_limit(model, hw, wl, pl)
            # a fine grid of concurrencies (5% apart) so the cliff is placed to within 5%
            cs = sorted({int(round(x)) for x in np.geomspace(1, max(1, limit.concurrency), 200)})
            pts = [predict_point(model, hw, wl, pl, c) for c in cs] if limit.concurrency >= 1 else []
            cliff = next((p for p in pts if p.binding == "kv link"), None)
            out[(hname, pl.label)] = {"limit": limit.concurrency, "limit_binding": limit.binding,
                                      "peak_tok_s": max((p.throughput_tok_s for p in pts), default=0.0),
                                      "cliff_c": cliff.concurrency if cliff else None, "front": Front(pl, limit, pts)}
    return out


# (5): conversations over long shared documents (a codebase or a manual of 32K tokens opened by many users)
SPLIT_CONV = Conversations(doc_len=32768, question_len=512, answer_len=1024, turns=4, docs=100_000, think_s=30.0)
SPLIT_FRACTIONS = (0.0, 0.5, 0.85, 0.95)


def kv_engram_split(model: ModelSpec, hws: dict[str, HardwareSpec], conv: Conversations = SPLIT_CONV,
                    fractions: tuple[float, ...] = SPLIT_FRACTIONS, concurrencies: tuple[int, ...] = (256, 1024, 4096)
                    ) -> dict[str, Any]:
    """(5) per machine: each split of its host memory at each concurrency, its prefix reuse, the best split."""
    wl = conversations_workload(conv, max_num_seqs=1 << 14, max_num_batched_tokens=16384)
    out: dict[str, Any] = {}
    for hname, hw in hws.items():
        points: dict[str, list[Any]] = {}
        reuse: dict[tuple[str, int], Any] = {}
        for kind in ("host", "file"):
            for f in fractions:
                split = Split(hw.host_memory_bytes, f, kind, hot_rows=kind == "file")
                if kind == "host" and split.engram_bytes < model.engram.table_bytes:
                    continue
                for c in concurrencies:
                    p, got = predict_conversations(model, hw, conv, split, c, wl)
                    points.setdefault(split.label, []).append(p)
                    reuse[(split.label, c)] = got
        out[hname] = {"points": points, "reuse": reuse, "best": best_splits(points),
                      "block_bytes": wl.block_size * model.kv_bytes_per_token}
    return out


def decode_stall(model: ModelSpec, hw: HardwareSpec, hit_rates: dict[int, float], batches: tuple[int, ...] =
                 (1, 8, 64, 256), context: int = 8192, cache_fraction: float = 0.1) -> list[dict[str, Any]]:
    """(4) one decode step of c sequences: exposed stall, and with the top-k candidates' rows fetched a step early."""
    wl = Workload(input_len=context, output_len=1024, max_num_seqs=1 << 14)
    rows = []
    for kind in ("host", "file"):
        pl = Placement(kind, cache_fraction=cache_fraction if kind == "file" else 0.0)
        for c in batches:
            step, terms, binding, _ = step_terms_at(model, hw, wl, pl, c, float(c), float(context),
                                                    decode_tokens=float(c))
            base = terms.get("engram exposed", 0.0)
            row = {"placement": pl.label, "c": c, "step_ms": step * 1e3, "fetch_ms": terms.get("engram fetch", 0) * 1e3,
                   "exposed_ms": base * 1e3, "hide_ms": model.hide_fraction * terms["compute"] * 1e3}
            for k, p in hit_rates.items():
                _, tk, _, _ = step_terms_at(model, hw, wl, pl, c, float(c * k), float(context),
                                            decode_tokens=float(c * k))
                over = max(0.0, tk.get("engram fetch", 0.0) - (step - base))
                row[f"spec_k{k}_exposed_ms"] = (p * over + (1 - p) * base) * 1e3
            rows.append(row)
    return rows


def topk_hit_rate(model_dir: str, ks: tuple[int, ...] = (1, 4, 16), max_tokens: int = 20000,
                  progress: bool = True) -> dict[int, float]:
    """Share of next tokens on the corpus test split that are among the model's top-k predictions."""
    import torch
    from tqdm import tqdm

    from tiergram.corpus import ensure_corpus
    from tiergram.model.checkpoint import load_pretrained
    from tiergram.model.evaluate import document_windows, eval_documents

    model, tok = load_pretrained(model_dir)
    corpus = ensure_corpus(tokenizer=False, progress=progress)  # the text (built first on a fresh machine)
    docs = eval_documents(corpus, "test", tok, max_tokens_per_category=max_tokens // 4)
    windows = document_windows(docs, model.config.max_seq)
    hits = dict.fromkeys(ks, 0)
    total = 0
    with torch.no_grad():
        for _, w in tqdm(windows, desc="top-k", disable=not progress):
            if len(w) < 2:
                continue
            x = torch.from_numpy(w[:-1]).unsqueeze(0)
            y = torch.from_numpy(w[1:])
            logits, _ = model(x)
            top = logits[0].topk(max(ks), dim=-1).indices
            for k in ks:
                hits[k] += int((top[:, :k] == y[:, None]).any(-1).sum())
            total += len(y)
            if total >= max_tokens:
                break
    return {k: hits[k] / max(1, total) for k in ks} | {"tokens": total}  # type: ignore[dict-item]


# --------------------------------------------------------------------------------------------- output

def plot_panels(panels: dict[str, dict[str, tuple[list[float], list[float]]]], path: Path, xlabel: str, ylabel: str,
                cols: int = 0, xbase: float = 10, yscale: str = "log") -> Path:
    """One panel per title, a line per label of its (xs, ys) on log axes."""
    cols = cols or len(panels)
    rows = math.ceil(len(panels) / cols)
    fig, axes = subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), dpi=100, squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items(), strict=False):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker=".", label=label)
        ax.set_xscale("log", base=xbase)
        ax.set_yscale(yscale, **({"linthresh": 1e-3} if yscale == "symlog" else {}))
        label_axes(ax, xlabel, ylabel, title, legend=6)
    return save_figure(fig, path)


def _by_users(points: dict[str, list[Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Each line's throughput against concurrency."""
    return {k: ([p.concurrency for p in pts], [p.throughput_tok_s for p in pts]) for k, pts in points.items() if pts}


def _fronts(res: dict[str, Any], kind: str) -> dict[str, Any]:
    """(1)'s panels of one K/V kind: each placement's pareto front."""
    return {f"PREDICTED {k}": {f"{f.placement.label} (c<={f.limit.concurrency})": (
        [p.interactivity for p in f.pareto], [p.throughput_tok_s for p in f.pareto]) for f in v["fronts"] if f.points}
        for k, v in res.items() if kind in k}


def run(out: Path, model_dir: str | None, progress: bool = True) -> str:
    """All five studies: PNGs into `out`, a markdown summary returned (every figure labelled a prediction)."""
    from tiergram.analysis.stats import md_table  # (tiergram.analysis imports torch)
    from tiergram.plan.specs import load_hardware, load_model

    out.mkdir(parents=True, exist_ok=True)
    model = load_model("deepseek-v4.1-flash")
    h200, b200, gb300 = (load_hardware(n) for n in ("h200", "b200", "gb300"))
    md = ["All figures below are PREDICTIONS of `tiergram plan` from the shipped specs (`tiergram plan studies`)."]
    # (1)
    md.append("\n### (1) DRAM offload against HBM-resident tables\n")
    res1, rows1 = {}, []
    # V3.2's MLA cache (61 layers x 576 bf16 values = 70,272 B per token): a model whose K/V binds memory first
    mla = replace(model, kv_bytes_per_token=70272.0)
    for label, m in (("V4.1 spec", model), ("MLA K/V (V3.2-style)", mla)):
        r = offload_vs_resident(m, {"H200": h200, "B200": b200})
        for key, v in r.items():
            res1[f"{key} ({label})"] = v
            rows1.append([key, f"{m.kv_bytes_per_token:,.0f}", f"{v['device_limit']:,} ({v['device_binding']}) → "
                          f"{v['host_limit']:,} ({v['host_binding']})", f"{v['median_ratio']:.3f}, "
                          f"{v['max_ratio']:.3f}", f"{v['share_host_better']:.0%}"])
    md.append(md_table(["machine, workload (in/out)", "K/V bytes/token", "limit resident → host", "host / resident at "
                        "equal interactivity: median, max", "share of the range where host is >1% better"], rows1))
    for kind, name in (("V4.1", "offload-vs-resident"), ("MLA", "offload-vs-resident-mla-kv")):
        plot_panels(_fronts(res1, kind), out / f"{name}.png", "tok/s per user", "tok/s", cols=len(WORKLOADS))
    # (2)
    res2 = ssd_vs_dram(model, {"H200": h200, "B200": b200})
    drives = sorted({d for _, _, d in res2})
    caches = sorted({(h, c) for h, c, _ in res2})
    ssd = {f"{h}, cache {c}": (drives, [res2[(h, c, d)]["max_tok_s_ratio"] for d in drives]) for h, c in caches}
    ssd["SemiAnalysis mmap path, tokens/$ (52M vs 121M)"] = ([drives[0], drives[-1]], [52 / 121] * 2)
    plot_panels({"PREDICTED: DeepSeek-V4.1-Flash 8K/1K, NVMe vs DRAM tables": ssd}, out / "ssd-vs-dram.png",
                "NVMe drives", "file / host, best throughput (= tokens per $)", xbase=2, yscale="linear")
    md.append("\n### (2) NVMe against DRAM, by drive count (8K/1K; file / host best throughput = tokens per $)\n")
    md.append(md_table(["machine", "cache", *(f"{d} drives" for d in drives)], (
        [h, c, *(f"{res2[(h, c, d)]['max_tok_s_ratio']:.2f} ({res2[(h, c, d)]['binding_at_max']})" for d in drives)]
        for h, c in caches)))
    # (3)
    res3 = contention(model, {"H200": h200, "B200": b200, "GB300": gb300})
    plot_panels({f"PREDICTED {h}: 128K in / 4K out": _by_users({f"{label} (c<={r['limit']:,})": r["front"].points
                                                                for (hh, label), r in res3.items() if hh == h})
                 for h in sorted({h for h, _ in res3})}, out / "kv-engram-contention.png", "concurrency", "tok/s",
                xbase=2)
    md.append("\n### (3) K/V offload and Engram sharing host DRAM and the link (128K in / 4K out)\n")
    md.append(md_table(["machine", "placement", "concurrency limit (binds)", "peak tok/s",
                        "cliff: first c where the K/V link binds"],
                       ([h, label, f"{v['limit']:,} ({v['limit_binding']})", f"{v['peak_tok_s']:,.0f}",
                         "-" if v["cliff_c"] is None else v["cliff_c"]] for (h, label), v in res3.items())))
    # (5)
    res5 = kv_engram_split(model, {"H200": h200, "B200": b200})
    plot_panels({f"PREDICTED {h}: K/V tier vs Engram tables in DRAM": _by_users(r["points"]) for h, r in res5.items()},
                out / "kv-engram-split.png", "users (closed loop, 30 s think)", "tok/s", xbase=2)
    conv = SPLIT_CONV
    md.append(f"\n### (5) One host memory for the host K/V tier and the Engram tables ({conv.docs:,} shared documents "
              f"of {conv.doc_len // 1024}K tokens, {conv.turns} turns of {conv.question_len} + {conv.answer_len}, "
              f"{conv.think_s:g} s between turns)\n")
    head = ["machine", "split (tables + K/V share of host memory)", "c", "prefix hit", "of it from host",
            "prefix cache, GB (device room + host tier)", "running", "tok/s", "binds"]
    for hname, r in res5.items():
        rows = []
        for label, pts in r["points"].items():
            for p in pts:
                g = r["reuse"][(label, p.concurrency)]
                rows.append([hname, label, f"{p.concurrency:,}", f"{g.hit_rate:.1%}", f"{g.host_hit_rate:.1%}",
                             f"{g.evictable_blocks * r['block_bytes'] / 1e9:,.0f}", f"{p.running:,.0f}",
                             f"{p.throughput_tok_s:,.0f}", p.binding])
        best = "; ".join(f"c = {c:,}: {name} (by {m - 1:.1%})" for c, (name, m) in r["best"].items())
        md += [md_table(head, rows), "", f"{hname} best split: {best}", ""]
    # (4)
    hits = {1: 0.0, 4: 0.0, 16: 0.0}
    measured = ""
    if model_dir:
        got = topk_hit_rate(model_dir, tuple(hits), progress=progress)
        hits = {k: float(got[k]) for k in hits}
        measured = (f"top-k hit rates of `{Path(model_dir).name}` on {got['tokens']:,} test-split tokens: "
                    + ", ".join(f"k={k}: {v:.1%}" for k, v in hits.items()))
    rows = decode_stall(model, h200, hits)
    panels = {}
    for pl in sorted({r["placement"] for r in rows}):
        rs = [r for r in rows if r["placement"] == pl]
        cs = [r["c"] for r in rs]
        panels[f"PREDICTED H200 decode, {pl}"] = {"no speculation": (cs, [r["exposed_ms"] for r in rs]), **{
            f"top-{k} prefetched": (cs, [r[f"spec_k{k}_exposed_ms"] for r in rs]) for k in hits},
            "step": (cs, [r["step_ms"] for r in rs])}
    plot_panels(panels, out / "decode-stall-h200.png", "decode batch (sequences)", "ms per step", xbase=2,
                yscale="symlog")
    md.append("\n### (4) Decode on H200: exposed stall per step (8K context, file with a 10% host cache)\n")
    if measured:
        md.append(measured + "\n")
    md.append(md_table(["placement", "c", "step ms", "fetch ms", "hidden by embedding + block 0, ms", "exposed ms",
                        *(f"top-{k} spec. exposed ms" for k in hits)],
                       ([r["placement"], r["c"], f"{r['step_ms']:.2f}", f"{r['fetch_ms']:.3f}", f"{r['hide_ms']:.3f}",
                         f"{r['exposed_ms']:.3f}", *(f"{r[f'spec_k{k}_exposed_ms']:.3f}" for k in hits)]
                        for r in rows)))
    return "\n".join(md) + "\n"
