"""`tiergram plan studies`: the planner's predictions beyond this machine (docs/planner.md), with their plots.

(1) DRAM offload against HBM-resident tables for DeepSeek-V4.1-Flash on H200 and B200; (2) NVMe (prefetched,
cached io_uring) against DRAM, by drive count; (3) K/V offload and Engram sharing host DRAM and the link at long
contexts; (4) the exposed stall of a decode step on H200 with host (UVA) and NVMe tables, and what speculative
prefetch of the top-k next tokens' rows would hide, with the demo model's measured top-k hit rate as the stand-in;
(5) one host memory split between the prefix cache's host K/V tier and the Engram tables, for conversations over
long shared documents.
Every number here is a PREDICTION from the specs' figures and stated assumptions.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.plan import Front, HardwareSpec, ModelSpec, Placement, Workload, predict_front, predict_point
from tiergram.plan.model import concurrency_limit, step_terms_at
from tiergram.plan.prefix import Conversations
from tiergram.plan.split import Split, best_splits, conversations_workload, predict_conversations
from tiergram.plots import save_figure, subplots

QD_PER_DRIVE, READER_THREADS_PER_DRIVE = 128, 4
WORKLOADS = {"8K/1K": (8192, 1024), "1K/8K": (1024, 8192), "128K/4K": (131072, 4096)}


def envelope(front: Front, grid: np.ndarray) -> np.ndarray:
    """Best throughput a front reaches at interactivity >= each grid value (nan where it never does)."""
    out = np.full(len(grid), np.nan)
    for i, x in enumerate(grid):
        ok = [p.throughput_tok_s for p in front.points if p.interactivity >= x]
        if ok:
            out[i] = max(ok)
    return out


def _workload(name: str, max_num_seqs: int = 4096) -> Workload:
    i, o = WORKLOADS[name]
    return Workload(input_len=i, output_len=o, max_num_seqs=max_num_seqs, max_num_batched_tokens=16384)


def offload_vs_resident(model: ModelSpec, hws: dict[str, HardwareSpec]) -> dict[str, Any]:
    """(1) host / device throughput at equal interactivity over the device front, per machine and workload."""
    out: dict[str, Any] = {}
    for hname, hw in hws.items():
        for wname in WORKLOADS:
            wl = _workload(wname)
            dev = predict_front(model, hw, wl, Placement("device"))
            host = predict_front(model, hw, wl, Placement("host"))
            if not dev.points:
                out[f"{hname} {wname}"] = {"device_fits": False, "host_limit": host.limit.concurrency,
                                           "fronts": (dev, host)}
                continue
            xs = [p.interactivity for f in (dev, host) for p in f.points]
            grid = np.geomspace(min(xs), max(xs), 200)
            ratio = envelope(host, grid) / envelope(dev, grid)
            ratio = ratio[~np.isnan(ratio)]
            out[f"{hname} {wname}"] = {
                "device_fits": True, "device_limit": dev.limit.concurrency, "device_binding": dev.limit.binding,
                "host_limit": host.limit.concurrency, "host_binding": host.limit.binding,
                "share_host_better": float((ratio > 1.01).mean()), "median_ratio": float(np.median(ratio)),
                "max_ratio": float(ratio.max()), "fronts": (dev, host)}
    return out


def ssd_vs_dram(model: ModelSpec, hws: dict[str, HardwareSpec], drives: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                fractions: tuple[float, ...] = (0.01, 0.1), workload: str = "8K/1K") -> dict[str, Any]:
    """(2) file / host throughput (same node, so the same cost per hour: tokens per dollar) by drive count; keys
    (machine, cache label, drives), the label "10%" or, with the model's hot-row curve, "10% + hot rows"."""
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


# (5): conversations over long shared documents: a codebase or a manual of 32K tokens opened by many users (document i
# with weight 1/(i+1)), 4 turns of a 512-token question and a 1,024-token answer, 30 s of reading between turns
SPLIT_CONV = Conversations(doc_len=32768, question_len=512, answer_len=1024, turns=4, docs=100_000, think_s=30.0)
SPLIT_FRACTIONS = (0.0, 0.5, 0.85, 0.95)


def kv_engram_split(model: ModelSpec, hws: dict[str, HardwareSpec], conv: Conversations = SPLIT_CONV,
                    fractions: tuple[float, ...] = SPLIT_FRACTIONS, concurrencies: tuple[int, ...] = (256, 1024, 4096)
                    ) -> dict[str, Any]:
    """(5) per machine: each split of its host memory (tables in DRAM, or on NVMe behind a hot-row cache, the rest to
    the host K/V tier) at each concurrency, with its prefix reuse; the best split per concurrency."""
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
    """(4) one decode step of c sequences: exposed stall, and with speculative prefetch of the top-k candidates.

    Speculation: the rows of the k most likely next tokens are fetched one step early (while the whole previous
    step runs); with probability p_k the real token is among them and only what that bigger fetch overruns the
    step is exposed; otherwise the step fetches its own rows as without speculation.
    """
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
                row[f"spec_k{k}_fetch_ms"] = tk.get("engram fetch", 0.0) * 1e3
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

def _label(ax, x: str, y: str, title: str, *, legend: int = 7) -> None:
    """Axis labels, title, a light grid and the legend of one study panel."""
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=legend)


def plot_offload(res: dict[str, Any], path: Path) -> Path:
    """(1) device vs host fronts, one panel per machine and workload."""
    keys = list(res)
    cols = len(WORKLOADS)
    rows = math.ceil(len(keys) / cols)
    fig, axes = subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), dpi=100, squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for f in res[key]["fronts"]:
            pts = f.pareto
            if pts:
                ax.plot([p.interactivity for p in pts], [p.throughput_tok_s for p in pts], marker=".",
                        label=f"{f.placement.label} (c<={f.limit.concurrency})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"PREDICTED {key}", fontsize=8)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=6)
        ax.set_xlabel("tok/s per user", fontsize=7)
        ax.set_ylabel("tok/s", fontsize=7)
    return save_figure(fig, path)


def plot_ssd(res: dict[Any, Any], path: Path) -> Path:
    """(2) file / host best throughput against drive count."""
    fig, ax = subplots(figsize=(6.0, 4.0), dpi=100)
    for hname, label in sorted({(h, c) for h, c, _ in res}):
        ds = sorted(d for h, c, d in res if h == hname and c == label)
        ax.plot(ds, [res[(hname, label, d)]["max_tok_s_ratio"] for d in ds], marker="o",
                linestyle="--" if "hot" in label else "-", label=f"{hname}, cache {label}")
    ax.axhline(52 / 121, color="grey", ls="--", lw=1,
               label="SemiAnalysis mmap path, tokens/$ (52M vs 121M)")
    ax.set_xscale("log", base=2)
    _label(ax, "NVMe drives", "file / host, best throughput (= tokens per $)",
           "PREDICTED: DeepSeek-V4.1-Flash 8K/1K, NVMe vs DRAM tables")
    return save_figure(fig, path)


def plot_by_users(panels: dict[str, dict[str, list[Any]]], path: Path, xlabel: str, title: str,
                  split_styles: bool = False) -> Path:
    """(3), (5): per machine (`title` formats its name), each line's points' throughput against concurrency; with
    split_styles, host lines solid and file lines dashed."""
    fig, axes = subplots(1, len(panels), figsize=(5.0 * len(panels), 3.8), dpi=100, squeeze=False)
    for ax, (hname, lines) in zip(axes.flat, panels.items(), strict=True):
        for label, pts in lines.items():
            host = split_styles and "host" in label
            ax.plot([p.concurrency for p in pts], [p.throughput_tok_s for p in pts], marker="o" if host else ".",
                    ls="-" if host or not split_styles else "--", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _label(ax, xlabel, "tok/s", title.format(hname), legend=6)
    return save_figure(fig, path)


def plot_decode(rows: list[dict[str, Any]], ks: tuple[int, ...], path: Path) -> Path:
    """(4) exposed stall per decode step, without and with speculative top-k prefetch."""
    fig, axes = subplots(1, 2, figsize=(10, 3.8), dpi=100)
    for ax, pl in zip(axes, sorted({r["placement"] for r in rows}), strict=True):
        rs = [r for r in rows if r["placement"] == pl]
        cs = [r["c"] for r in rs]
        ax.plot(cs, [r["exposed_ms"] for r in rs], marker="o", label="no speculation")
        for k in ks:
            ax.plot(cs, [r[f"spec_k{k}_exposed_ms"] for r in rs], marker=".", label=f"top-{k} prefetched")
        ax.plot(cs, [r["step_ms"] for r in rs], color="grey", ls=":", label="step")
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1e-3)
        _label(ax, "decode batch (sequences)", "ms per step", f"PREDICTED H200 decode, {pl}")
    return save_figure(fig, path)


def run(out: Path, model_dir: str | None, progress: bool = True, topk_tokens: int = 20000) -> str:
    """All four studies: PNGs into `out`, a markdown summary returned (every figure labelled a prediction)."""
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
    plot_offload({k: v for k, v in res1.items() if "V4.1" in k}, out / "offload-vs-resident.png")
    plot_offload({k: v for k, v in res1.items() if "MLA" in k}, out / "offload-vs-resident-mla-kv.png")
    # (2)
    res2 = ssd_vs_dram(model, {"H200": h200, "B200": b200})
    plot_ssd(res2, out / "ssd-vs-dram.png")
    md.append("\n### (2) NVMe against DRAM, by drive count (8K/1K; file / host best throughput = tokens per $)\n")
    drives = sorted({d for _, _, d in res2})
    md.append(md_table(["machine", "cache", *(f"{d} drives" for d in drives)], (
        [h, c, *(f"{res2[(h, c, d)]['max_tok_s_ratio']:.2f} ({res2[(h, c, d)]['binding_at_max']})" for d in drives)]
        for h, c in sorted({(h, c) for h, c, _ in res2}))))
    # (3)
    res3 = contention(model, {"H200": h200, "B200": b200, "GB300": gb300})
    lines3 = {h: {f"{label} (c<={r['limit']:,})": r["front"].points for (hh, label), r in res3.items()
                  if hh == h and r["front"].points} for h in sorted({h for h, _ in res3})}
    plot_by_users(lines3, out / "kv-engram-contention.png", "concurrency", "PREDICTED {}: 128K in / 4K out")
    md.append("\n### (3) K/V offload and Engram sharing host DRAM and the link (128K in / 4K out)\n")
    md.append(md_table(["machine", "placement", "concurrency limit (binds)", "peak tok/s",
                        "cliff: first c where the K/V link binds"],
                       ([h, label, f"{v['limit']:,} ({v['limit_binding']})", f"{v['peak_tok_s']:,.0f}",
                         "-" if v["cliff_c"] is None else v["cliff_c"]] for (h, label), v in res3.items())))
    # (5)
    res5 = kv_engram_split(model, {"H200": h200, "B200": b200})
    plot_by_users({h: r["points"] for h, r in res5.items()}, out / "kv-engram-split.png", "users (closed loop, 30 s "
                  "think)", "PREDICTED {}: K/V tier vs Engram tables in DRAM", split_styles=True)
    md.append(kv_split_markdown(res5))
    # (4)
    hits = {1: 0.0, 4: 0.0, 16: 0.0}
    measured = ""
    if model_dir:
        got = topk_hit_rate(model_dir, tuple(hits), topk_tokens, progress)
        hits = {k: float(got[k]) for k in hits}
        measured = (f"top-k hit rates of `{Path(model_dir).name}` on {got['tokens']:,} test-split tokens: "
                    + ", ".join(f"k={k}: {v:.1%}" for k, v in hits.items()))
    rows = decode_stall(model, h200, hits)
    plot_decode(rows, tuple(hits), out / "decode-stall-h200.png")
    md.append("\n### (4) Decode on H200: exposed stall per step (8K context, file with a 10% host cache)\n")
    if measured:
        md.append(measured + "\n")
    md.append(md_table(["placement", "c", "step ms", "fetch ms", "hidden by embedding + block 0, ms", "exposed ms",
                        *(f"top-{k} spec. exposed ms" for k in hits)],
                       ([r["placement"], r["c"], f"{r['step_ms']:.2f}", f"{r['fetch_ms']:.3f}", f"{r['hide_ms']:.3f}",
                         f"{r['exposed_ms']:.3f}", *(f"{r[f'spec_k{k}_exposed_ms']:.3f}" for k in hits)]
                        for r in rows)))
    return "\n".join(md) + "\n"


def kv_split_markdown(res: dict[str, Any], conv: Conversations = SPLIT_CONV) -> str:
    """(5) as a table per machine: every split and concurrency, its prefix reuse and throughput; the best split per
    c."""
    from tiergram.analysis.stats import md_table

    md = [f"\n### (5) One host memory for the host K/V tier and the Engram tables ({conv.docs:,} shared documents of "
          f"{conv.doc_len // 1024}K tokens, {conv.turns} turns of {conv.question_len} + {conv.answer_len}, "
          f"{conv.think_s:g} s between turns)\n"]
    head = ["machine", "split (tables + K/V share of host memory)", "c", "prefix hit", "of it from host",
            "prefix cache, GB (device room + host tier)", "running", "tok/s", "binds"]
    for hname, r in res.items():
        rows = []
        for label, pts in r["points"].items():
            for p in pts:
                g = r["reuse"][(label, p.concurrency)]
                rows.append([hname, label, f"{p.concurrency:,}", f"{g.hit_rate:.1%}", f"{g.host_hit_rate:.1%}",
                             f"{g.evictable_blocks * r['block_bytes'] / 1e9:,.0f}", f"{p.running:,.0f}",
                             f"{p.throughput_tok_s:,.0f}", p.binding])
        best = "; ".join(f"c = {c:,}: {name} (by {m - 1:.1%})" for c, (name, m) in r["best"].items())
        md += [md_table(head, rows), "", f"{hname} best split: {best}", ""]
    return "\n".join(md)
