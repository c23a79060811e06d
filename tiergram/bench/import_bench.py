"""`tiergram bench import`: `tiergram import` of a V4.1-layout checkpoint against this disk's own copy rate.

A synthetic checkpoint (`v41_checkpoint`) is written, then in rounds of alternating order, each after dropping it
from the page cache, the disk copies its Engram tensors and `tiergram import` runs in a child process (its peak RSS
from wait4). docs/benchmarks.md, "Importing DeepSeek-V4.1's tables".
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tiergram.bench.common import drop_page_cache, log
from tiergram.bench.table_io import BLOCK
from tiergram.bench.v41_checkpoint import rows_for_gib, write_v41_checkpoint
from tiergram.format.safetensors_index import TensorLocation, locate_tensors
from tiergram.format.writer import aligned_pages, free_bytes


def copy_limit(ranges: list[TensorLocation], directory: Path) -> float:
    """Bytes/s of copying the tensors into a new file (removed after): 32 MiB buffered reads in this thread,
    O_DIRECT writes in another, fsync: the import's own I/O with none of its work per row."""
    dst = directory / f".tiergram-copy-limit-{os.getpid()}"
    bufs = [aligned_pages(BLOCK) for _ in range(4)]
    writes: list[Future] = []  # one per block, in order; block k is in bufs[k % 4]
    wfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        with ThreadPoolExecutor(1) as pool:
            t0, total, fill = time.perf_counter(), 0, 0
            for t in ranges:  # blocks are filled across tensor boundaries, so every write but the last is whole
                rfd = os.open(t.file, os.O_RDONLY)
                try:
                    done = 0
                    while done < t.nbytes:
                        if fill == 0 and len(writes) >= len(bufs):
                            writes[-len(bufs)].result()  # the buffer is free again (or its write's error raises)
                        buf = bufs[len(writes) % len(bufs)]
                        n = os.preadv(rfd, [memoryview(buf)[fill: fill + min(BLOCK - fill, t.nbytes - done)]],
                                      t.offset + done)
                        if n <= 0:
                            raise OSError(f"{t.file}: short read at byte {t.offset + done:,}")
                        os.posix_fadvise(rfd, t.offset + done, n, os.POSIX_FADV_DONTNEED)  # as the import does
                        done, fill, total = done + n, fill + n, total + n
                        if fill == BLOCK:  # whole 32 MiB blocks at multiples of 32 MiB, as the table writer's
                            writes.append(pool.submit(os.pwrite, wfd, buf, total - fill))
                            fill = 0
                finally:
                    os.close(rfd)
            if fill:  # the last block, padded to whole pages
                writes.append(pool.submit(os.pwrite, wfd, memoryview(buf)[: -(-fill // 4096) * 4096], total - fill))
            for w in writes:
                w.result()
            os.fsync(wfd)
            return total / (time.perf_counter() - t0)
    finally:
        os.close(wfd)
        dst.unlink(missing_ok=True)


def import_once(ckpt: Path, out: Path) -> dict[str, float]:
    """Run `tiergram import` in a child process: wall seconds, the tables' own seconds, peak RSS bytes."""
    cmd = [sys.executable, "-c", "import sys; from tiergram.cli import main; sys.exit(main())",
           "import", str(ckpt), str(out), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"tiergram import exited {proc.returncode}: {err.strip()[-2000:]}")
    info = json.loads((out / "config.json").read_text())["import"]
    return {"wall_s": wall, "tables_s": info["tables_write_s"], "table_bytes": info["table_bytes"],
            "peak_rss_bytes": usage.ru_maxrss * 1024, "cpu_s": usage.ru_utime + usage.ru_stime}


def run(gib: float, directory: Path, *, rounds: int = 2, progress: bool = True) -> dict[str, Any]:
    """Write a gib-GiB checkpoint in directory, then import it and copy it in alternating rounds."""
    from tiergram.corpus import PAD, ensure_corpus, load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    need = int(gib * 2**30 * 3.1)  # the checkpoint, the imported tables (pages: +3.4%), the copy
    if need > free_bytes(directory):
        raise OSError(f"{directory}: the benchmark needs about {need / 2**30:.1f} GiB free, the disk has "
                      f"{free_bytes(directory) / 2**30:.1f} GiB")
    tok_path = ensure_corpus(progress=progress) / "tokenizer.json"
    pad = load_tokenizer(tok_path).token_to_id(PAD)
    ckpt, out = directory / "checkpoint", directory / "model"
    t0 = time.perf_counter()
    write_v41_checkpoint(ckpt, tok_path, engram_vocab_size=rows_for_gib(gib), pad_token_id=pad, progress=progress)
    write_s = time.perf_counter() - t0
    shards = sorted(ckpt.glob("*.safetensors"))
    ckpt_bytes = sum(p.stat().st_size for p in shards)
    config = json.loads((ckpt / "config.json").read_text())["text_config"]
    tensors = list(locate_tensors(ckpt, [f"layers.{layer}.engram.embed.{kind}" for layer in config["engram_layer_ids"]
                                         for kind in ("weight", "scale")]).values())
    copies, imports = [], []
    for r in range(rounds):
        for op in (("copy", "import") if r % 2 == 0 else ("import", "copy")):
            for shard in shards:
                drop_page_cache(shard)
            if op == "copy":
                copies.append(copy_limit(tensors, directory))
                log(progress, f"round {r + 1}: disk copy limit {copies[-1] / 2**30:.2f} GiB/s")
            else:
                imports.append(import_once(ckpt, out))
                i = imports[-1]
                log(progress, f"round {r + 1}: import {i['table_bytes'] / i['tables_s'] / 2**30:.2f} GiB/s (tables), "
                              f"{i['wall_s']:.1f} s whole command, peak RSS {i['peak_rss_bytes'] / 2**20:.0f} MiB")
    ratios = [i["table_bytes"] / i["tables_s"] / c for i, c in zip(imports, copies, strict=True)]
    return {"checkpoint_bytes": ckpt_bytes, "checkpoint_write_s": write_s, "checkpoint": str(ckpt),
            "model": str(out), "copy_limit": copies, "imports": imports, "ratios": ratios,
            "ratio_median": statistics.median(ratios),
            "peak_rss_bytes": max(i["peak_rss_bytes"] for i in imports)}


def report(r: dict[str, Any]) -> str:
    """The rounds as a table, the ratio against the 0.8 target, and the next command."""
    lines = [f"checkpoint {r['checkpoint_bytes'] / 2**30:.2f} GiB (DeepSeek-V4.1 layout, 3 shards) written in "
             f"{r['checkpoint_write_s']:.1f} s ({r['checkpoint_bytes'] / r['checkpoint_write_s'] / 2**30:.2f} GiB/s)",
             "", "| round | disk copy limit GiB/s | import GiB/s (tables) | import / limit | whole command s | "
             "peak RSS MiB | CPU s |", "|---|---|---|---|---|---|---|"]
    for k, (c, i, q) in enumerate(zip(r["copy_limit"], r["imports"], r["ratios"], strict=True)):
        lines.append(f"| {k + 1} | {c / 2**30:.2f} | {i['table_bytes'] / i['tables_s'] / 2**30:.2f} | {q:.2f} | "
                     f"{i['wall_s']:.1f} | {i['peak_rss_bytes'] / 2**20:.0f} | {i['cpu_s']:.1f} |")
    med, lo, hi = r["ratio_median"], min(r["ratios"]), max(r["ratios"])
    verdict = "PASS" if med >= 0.8 else "WITHIN NOISE" if hi >= 0.8 else "FAIL"
    rss = r["peak_rss_bytes"] / 2**20
    lines += ["", f"import / disk copy limit: median {med:.2f} (rounds {lo:.2f}-{hi:.2f}), target >= 0.8: {verdict}",
              f"peak RSS {rss:.0f} MiB, target <= 1024: {'PASS' if rss <= 1024 else 'FAIL'}",
              f"serve it: tiergram bench serve {r['model']} --placements host,file"]
    return "\n".join(lines)
