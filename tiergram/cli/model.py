"""`tiergram train | eval | export | init-model | import | hot-rows | generate`: the reference Engram LM."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from tiergram.cli.common import add_common, config_from

TIERS = ("memory", "host", "file")  # mirrors model.checkpoint.TIERS without importing torch (checked by a test)


def _count(text: str) -> int:
    """'2000000', '2M', '500k' -> an int."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 2000000, 2M or 500k, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count, got {text!r}")
    return int(value)


def load_with_tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) of args.dir on args.tier and args.device; ValueError when it has no tokenizer.json."""
    from tiergram.model.checkpoint import load_pretrained
    from tiergram.tiers.device import resolve_device

    model, tokenizer = load_pretrained(args.dir, tier=args.tier, device=resolve_device(args.device))
    if tokenizer is None:
        raise ValueError(f"{args.dir} has no tokenizer.json")
    return model, tokenizer


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train the reference Engram LM on the corpus (or resume a run)")
    t.add_argument("--out", required=True, help="run directory (model, checkpoint, logs, eval.json)")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=_count, help="token budget, e.g. 3M")
    budget.add_argument("--minutes", type=float, help="wall-clock budget")
    t.add_argument("--config", default="small", choices=["small", "tiny", "small-moe", "tiny-moe"],
                   help="model preset (default small; *-moe: MoE FFNs, docs/model.md)")
    t.add_argument("--no-engram", action="store_true", help="the same backbone without Engram layers")
    add_common(t, "--seed")
    t.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt with its saved settings")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--checkpoint-every", type=int, default=250, help="steps between checkpoints")
    t.add_argument("--eval-tokens", type=int, default=131072,
                   help="tokens per category in the final evaluation (0: all)")
    add_common(t, "--corpus", "--device")
    t.add_argument("--stop-after", type=int, help="end this run after N steps (checkpointed; resume later)")
    add_common(t, "--quiet")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out loss per category with 95%% confidence intervals")
    e.add_argument("dir", help="model directory")
    e.add_argument("--split", default="validation", choices=["validation", "test"])
    e.add_argument("--no-engram-at-inference", action="store_true", help="zero every Engram output (ablation)")
    e.add_argument("--tier", default="memory", choices=TIERS, help="where the tables are read from")
    e.add_argument("--max-tokens", type=int, default=131072, help="tokens per category (0: all)")
    e.add_argument("--batch-size", type=int, default=16)
    add_common(e, "--corpus", "--device", "--json", "--quiet")
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="Engram tables -> table files, the rest -> safetensors, for serving")
    x.add_argument("dir", help="trained model directory")
    x.add_argument("--codec", default="fp8_e4m3", choices=["fp8_e4m3", "bf16", "fp32", "int8"])
    x.add_argument("--out", help="output directory (default DIR/export)")
    add_common(x, "--quiet")
    x.set_defaults(func=cmd_export)

    i = sub.add_parser("init-model", help="a servable model directory with DeepSeek-V4.1's Engram geometry (2 layers "
                                         "x 24 heads, 264-byte fp8_e4m3 rows) at a chosen table size, random weights")
    i.add_argument("out", help="output model directory")
    i.add_argument("--table-gib", type=float, required=True,
                   help="both tables together, GiB on disk (rows per head scaled to fit)")
    i.add_argument("--backbone", default="small", choices=["small", "tiny"], help="backbone preset (random weights)")
    i.add_argument("--tokenizer", help="tokenizer.json or a folder holding one (default: the corpus's)")
    add_common(i, "--seed", "--quiet")
    i.set_defaults(func=cmd_init_model)

    m = sub.add_parser("import", help="a released checkpoint's Engram tables (DeepSeek-V4.1) -> table files, byte for "
                                      "byte, in a servable directory with a random backbone")
    m.add_argument("ckpt", help="checkpoint directory: config.json, model.safetensors.index.json (or "
                                "model.safetensors) and its shards, tokenizer.json")
    m.add_argument("out", help="output model directory (serve, bench serve, table verify, hot-rows, plan take it)")
    m.add_argument("--tokenizer", help="tokenizer.json to hash with (default: the checkpoint's)")
    m.add_argument("--backbone", default="small", choices=["small", "tiny"],
                   help="the random backbone the tables are served with (the checkpoint's is not imported)")
    add_common(m, "--quiet")
    m.set_defaults(func=cmd_import)

    h = sub.add_parser("hot-rows", help="rank each Engram layer's rows by how often the corpus's train split reads "
                                        "them, for the engine to preload into a cold cache (serve --hot-rows)")
    h.add_argument("dir", help="model directory (its hashing and tokenizer)")
    add_common(h, "--corpus", corpus="corpus folder (default: the cache's corpus, built if absent)")
    h.add_argument("--tokens", type=_count, help="count only the split's first N tokens (e.g. 2M)")
    h.add_argument("--max-fraction", type=float, default=0.25,
                   help="keep at most this fraction of each layer's rows, the most read (default 0.25)")
    h.add_argument("--out", help="output file (default DIR/hot_rows.npz)")
    add_common(h, "--quiet")
    h.set_defaults(func=cmd_hot_rows)

    g = sub.add_parser("generate", help="generate text with the K/V cache and streaming hashing")
    g.add_argument("dir", help="model directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--tier", default="memory", choices=TIERS,
                   help="memory: trained tables; host/file: exported table files (DIR or DIR/export)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int)
    add_common(g, "--seed")
    g.add_argument("--no-engram-at-inference", action="store_true")
    add_common(g, "--device")
    g.set_defaults(func=cmd_generate)


def cmd_train(args: argparse.Namespace) -> int:
    from tiergram.model.train import TrainConfig, train

    if args.resume:  # the saved settings are used
        cfg = TrainConfig.load(args.out)
        print(f"resuming {args.out} with its saved settings", file=sys.stderr)
    else:  # TrainConfig refuses a missing budget
        cfg = dataclasses.replace(config_from(TrainConfig, args), engram=not args.no_engram,
                                  eval_tokens=args.eval_tokens or None)
    summary = train(cfg, resume=args.resume, progress=not args.quiet, stop_after=args.stop_after)
    print(json.dumps({k: v for k, v in summary.items() if k != "eval"}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from tiergram.corpus import ensure_corpus
    from tiergram.model.evaluate import evaluate, format_eval

    model, tokenizer = load_with_tokenizer(args)
    corpus = ensure_corpus(args.corpus, tokenizer=False)  # the text, built first on a fresh machine
    result = evaluate(model, corpus, args.split, tokenizer, max_tokens_per_category=args.max_tokens or None,
                      batch_size=args.batch_size, engram_enabled=not args.no_engram_at_inference,
                      progress=not args.quiet)
    result["model"], result["tier"] = str(args.dir), args.tier
    print(json.dumps(result, indent=1) if args.json else format_eval(result))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tiergram.model.export import export_model

    out = export_model(args.dir, args.codec, args.out, progress=not args.quiet)
    print(f"exported to {out}")
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from tiergram.model.checkpoint import read_config
    from tiergram.model.init_model import init_model

    out = init_model(args.out, table_gib=args.table_gib, backbone=args.backbone, tokenizer=args.tokenizer,
                     seed=args.seed, progress=not args.quiet)
    info = read_config(out)["init"]
    print(f"wrote {out}: {info['geometry']} Engram, {info['rows_per_head']:,} rows per head, tables "
          f"{info['table_bytes'] / 2**30:.2f} GiB written in {info['tables_write_s']:.1f} s "
          f"({info['table_bytes'] / max(info['tables_write_s'], 1e-9) / 2**30:.2f} GiB/s); random weights")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from tiergram.model.import_checkpoint import import_checkpoint

    import_checkpoint(args.ckpt, args.out, tokenizer=args.tokenizer, backbone=args.backbone, progress=not args.quiet,
                      log=lambda line: print(line, file=sys.stderr))
    return 0


def cmd_hot_rows(args: argparse.Namespace) -> int:
    from tiergram.model.hot_rows import count_model_hot_rows

    path, hot = count_model_hot_rows(args.dir, corpus=args.corpus, max_tokens=args.tokens,
                                     max_fraction=args.max_fraction, out=args.out, progress=not args.quiet)
    for layer in sorted(hot.keys):
        c, reads = hot.counts[layer], max(1, hot.reads[layer])
        print(f"layer {layer}: the {c.size:,} most read rows kept serve {int(c.sum()) / reads:.1%} of the "
              f"{reads:,} row reads of {hot.tokens:,} tokens; the first tenth of them "
              f"{int(c[: max(1, c.size // 10)].sum()) / reads:.1%}")
    print(f"wrote {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tiergram.corpus import EOT
    from tiergram.model.generate import generate

    model, tokenizer = load_with_tokenizer(args)
    eot = tokenizer.token_to_id(EOT)
    # training documents each follow <|endoftext|>, so a prompt starts like a document does
    prompt = ([eot] if eot is not None else []) + tokenizer.encode(args.prompt).ids
    sys.stdout.write(args.prompt)
    generated: list[int] = []
    shown = ""

    def show(token: int) -> None:  # decode the whole tail each time so multi-token characters print whole
        nonlocal shown
        generated.append(token)
        text = tokenizer.decode(generated)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    result = generate(model, prompt, args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                      seed=args.seed, stop_ids=[eot] if eot is not None else [],
                      engram_enabled=not args.no_engram_at_inference, on_token=show)
    print(f"\n[{len(prompt)} prompt tokens, {len(result.ids)} generated; prefill {result.prefill_s * 1e3:.0f} ms, "
          f"decode {result.decode_tok_s:.1f} tok/s, tier {args.tier}]", file=sys.stderr)
    return 0
