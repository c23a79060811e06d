"""`tiergram demo`: corpus, a trained Engram LM, its table files, a serving sweep and multi-turn conversations,
cached under $TIERGRAM_CACHE so a second run only repeats the sweeps (README.md)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MODEL_NAME = "demo-small"
CODEC = "fp8_e4m3"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="build the corpus, train (or reuse) the default model, export its tables and "
                                    "run a short serving sweep over device/host/file placements")
    p.add_argument("--minutes-train", type=float, default=None,
                   help="training budget of the default model on first use (default 4; --quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1-minute model, shorter requests, concurrency up to 4, 5 requests per user")
    p.add_argument("--retrain", action="store_true", help="train the default model again even if one is cached")
    p.add_argument("--no-binding-budget", action="store_true",
                   help="give every server the default device budget (by default the budget is sized so the "
                        "resident tables halve the K/V room, as HBM would)")
    p.add_argument("--out", default=None, help="folder for sweep.json, sweep.md and sweep.png (default: the cache)")
    p.set_defaults(func=cmd_demo)


def _stage(n: int, title: str, t0: float) -> None:
    print(f"\n== [{n}/5] {title}  (t = {time.perf_counter() - t0:.0f} s)", flush=True)


def ensure_model(model_dir: Path, minutes: float, retrain: bool) -> Path:
    """The default model: reused when trained, resumed when interrupted, else trained for `minutes`."""
    import shutil

    from tiergram.model.train import TrainConfig, train

    if retrain and model_dir.exists():
        shutil.rmtree(model_dir)
    config = model_dir / "config.json"
    training = (json.loads(config.read_text()).get("training") or {}) if config.is_file() else {}
    if training.get("finished"):
        print(f"reusing the trained model at {model_dir} ({training['steps']} steps; --retrain to train again)")
        return model_dir
    if (model_dir / "checkpoint.pt").is_file():
        print(f"resuming the interrupted training run in {model_dir}")
        train(TrainConfig.load(model_dir), resume=True)
        return model_dir
    print(f"training the `small` preset for {minutes:g} min into {model_dir}")
    train(TrainConfig(out=str(model_dir), config="small", minutes=minutes, warmup_steps=20, eval_tokens=16384,
                      checkpoint_every=100))
    return model_dir


def binding_budget(model_dir: Path, seqs: int, seq_tokens: int, max_num_seqs: int) -> int:
    """A device budget that leaves K/V room for `seqs` sequences of seq_tokens when the tables are resident."""
    from tiergram.engine import EngineConfig, LLMEngine

    with LLMEngine(EngineConfig(str(model_dir), "device", max_num_seqs=max_num_seqs)) as engine:
        b = engine.budget
    blocks = max(seqs * -(-seq_tokens // b.block_size), b.blocks_per_seq)  # the engine needs one full-length one
    return b.weights_bytes + b.device_table_bytes + b.activation_bytes + blocks * b.block_bytes


def cmd_demo(args: argparse.Namespace) -> int:
    from tiergram.bench import serve as sweep
    from tiergram.corpus import ensure_corpus
    from tiergram.model.checkpoint import WEIGHTS
    from tiergram.model.hot_rows import HOT_ROWS, count_model_hot_rows
    from tiergram.paths import cache_dir

    t0 = time.perf_counter()
    minutes = args.minutes_train if args.minutes_train is not None else (1.0 if args.quick else 4.0)
    _stage(1, "corpus and tokenizer (built once, then reused)", t0)
    corpus = ensure_corpus(progress=True)
    print(f"corpus at {corpus}; tokenizer at {corpus / 'tokenizer.json'}", flush=True)

    _stage(2, "the default Engram model", t0)
    model_dir = ensure_model(cache_dir("models") / MODEL_NAME, minutes, args.retrain)

    _stage(3, f"table files ({CODEC}, one per Engram layer)", t0)
    sizes = sweep.layer_table_bytes(str(model_dir), CODEC)
    print(f"{len(sizes)} tables, {sum(sizes) / 2**20:.1f} MiB in all, in {model_dir / 'export'}")

    hot = model_dir / HOT_ROWS  # counted again when missing or older than the weights
    if not hot.is_file() or hot.stat().st_mtime_ns < (model_dir / WEIGHTS).stat().st_mtime_ns:
        count_model_hot_rows(model_dir, corpus=corpus, progress=True)
    print(f"hot rows (preloaded into the file placement's cache at start): {hot}", flush=True)

    _stage(4, "serving sweep: device (resident) vs host (DRAM) vs file (SSD + 10% host cache)", t0)
    input_len, output_len, max_c, per_user, warm = (64, 16, 4, 2, 1) if args.quick else (128, 32, 16, 4, 2)
    out = Path(args.out) if args.out else cache_dir("demo")
    out.mkdir(parents=True, exist_ok=True)
    budget = None
    if not args.no_binding_budget:
        budget = binding_budget(model_dir, max(1, max_c // 2), input_len + output_len, 64)
        print(f"device budget {budget / 2**20:.1f} MiB: resident tables leave K/V room for {max(1, max_c // 2)} "
              f"requests, offloaded ones for more", flush=True)
    cfg = sweep.SweepConfig(model_dir=str(model_dir), input_len=input_len, output_len=output_len,
                            max_concurrency=max_c, requests_per_user=per_user, warmup_per_user=warm,
                            device_memory=budget, hot_rows=True, plot=str(out / "sweep.png"),
                            markdown=str(out / "sweep.md"))
    res = sweep.run(cfg, progress=True)
    (out / "sweep.json").write_text(sweep.to_json(res))
    print()
    print(sweep.to_text(res))
    print(f"json: {out / 'sweep.json'}\nmarkdown: {out / 'sweep.md'}")

    _stage(5, "prefix cache: multi-turn conversations over shared documents (host placement)", t0)
    conv = sweep.run(sweep.SweepConfig(
        model_dir=str(model_dir), placements=("host",), workload="conversations", input_len=48 if args.quick else 96,
        output_len=8 if args.quick else 16, max_concurrency=4, requests_per_user=2, warmup_per_user=0, rounds=1,
        device_memory=budget, plot=str(out / "conversations.png")), progress=True)
    (out / "conversations.json").write_text(sweep.to_json(conv))
    for p in conv.points:
        print(f"c={p.concurrency}: prefix-cache hit rate {100 * (p.prefix_hit_rate or 0):.1f}% of the prompt tokens "
              f"that could hit, TTFT p90 {p.ttft_p90_ms:.0f} ms, {p.throughput_tok_s:.0f} tok/s")
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f} s. Serve the model yourself with\n"
          f"  tiergram serve {model_dir} --placement host")
    return 0
