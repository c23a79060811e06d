"""`tiergram probe | ablate | analyze | predictor | compare-layers | sweep-allocation`: study what an Engram model's
memory holds and what it changes (docs/findings.md)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tiergram.cli.common import add_common, config_from
from tiergram.cli.model import TIERS, _count, load_with_tokenizer


def _split(p: argparse.ArgumentParser, split: str, max_tokens: int, what: str) -> None:
    p.add_argument("--split", default=split, choices=["validation", "test"], help=f"corpus split (default {split})")
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens per category {what} (0: the whole split; default {max_tokens})")
    p.add_argument("--batch-size", type=int, default=8)


def _common(p: argparse.ArgumentParser, split: str, max_tokens: int, what: str) -> None:
    p.add_argument("dir", help="model directory")
    _split(p, split, max_tokens, what)
    p.add_argument("--tier", default="memory", choices=TIERS, help="where the tables are read from")
    _inputs_outputs(p, "write the full result as JSON")


def _inputs_outputs(p: argparse.ArgumentParser, json_help: str, plot_help: str | None = None) -> None:
    """--corpus, --device, (--plot,) --json, --markdown and --quiet, which every study command takes."""
    add_common(p, "--corpus", "--device")
    if plot_help:
        add_common(p, "--plot", plot=plot_help)
    p.add_argument("--json", metavar="PATH", help=json_help)
    p.add_argument("--markdown", metavar="PATH", help="write the report as markdown (default: print it)")
    add_common(p, "--quiet")


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    """An argparse type: comma-separated values, each converted by `kind`."""
    return lambda text: tuple(kind(v.strip()) for v in text.split(",") if v.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="which n-grams open each Engram layer's gate, with category and examples")
    _common(p, "validation", 32768, "to probe")
    p.add_argument("--min-count", type=int, default=5, help="occurrences an n-gram needs to be ranked")
    p.add_argument("--top", type=int, default=30, help="n-grams listed per layer and order, highest and lowest")
    p.add_argument("--permutations", type=int, default=200,
                   help="gate shuffles for the between-n-gram null (0: no evidence table; default 200)")
    p.add_argument("--null-seed", type=int, default=0,
                   help="seed of the random-init model of the same config probed as the null (default 0)")
    p.set_defaults(func=cmd_probe)

    a = sub.add_parser("ablate", help="Engram off in prefill only / decode only / both / neither: loss and "
                                      "stdlib doctest generation")
    _common(a, "test", 8192, "for the teacher-forced loss")
    a.add_argument("--max-new", type=int, default=16, help="generated tokens per doctest task at most")
    a.add_argument("--no-generation", action="store_true", help="teacher-forced loss only")
    a.add_argument("--reroute", action="store_true",
                   help="MoE models: doctest answer loss with Engram on, off, and off with the Engram-on run's expert "
                        "choices forced, and the routing changes (instead of the prefill/decode ablation)")
    a.set_defaults(func=cmd_ablate)

    z = sub.add_parser("analyze", help="capacity accounting: rows touched per category, hotness vs gate")
    _common(z, "validation", 0, "hashed for the accounting")
    z.add_argument("--gate-tokens", type=int, default=16384,
                   help="tokens per category run through the model for the gates (default 16384)")
    z.add_argument("--resamples", type=int, default=200,
                   help="document resamples for the interval of Spearman(row reads, mean gate), of the model and of a "
                        "random-init null (0: no interval, no null; default 200)")
    z.add_argument("--null-seed", type=int, default=0, help="seed of the random-init null model (default 0)")
    add_common(z, "--plot", plot="hexbin PNG of access count vs mean gate")
    z.set_defaults(func=cmd_analyze)

    r = sub.add_parser("predictor", help="fit a pre-retrieval skip predictor on the other held-out split and compare "
                                         "it with training-run baselines and random skipping at matched skip rates")
    _common(r, "test", 3072, "evaluated")
    r.add_argument("--fit-tokens", type=int, default=8192, help="tokens per category to fit on (0: all)")
    r.add_argument("--rates", type=_csv(float), default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8",
                   help="skip rates: every method skips this share of the held-out positions' reads "
                        "(default 0.1,...,0.8)")
    r.add_argument("--methods", type=_csv(str), default="predictor,train-rare,train-gate,random,oracle",
                   help="comma-separated, of predictor, oracle, train-rare, train-gate, random (default: all)")
    r.add_argument("--doc-tokens", type=int, default=0,
                   help="tokens evaluated per held-out document at most, so --max-tokens spreads over more documents "
                        "(0: whole documents)")
    r.add_argument("--random-seeds", type=int, default=5, help="seeds of the random baseline (default 5)")
    r.add_argument("--train-gate-tokens", type=int, default=131072,
                   help="training tokens run through the model for train-gate's mean gates (default 131072)")
    r.add_argument("--sketch-width", type=int, default=2**16, help="count-min sketch cells per row (power of 2)")
    r.add_argument("--save", metavar="PATH", help="write the fitted SkipPredictor (.npz)")
    add_common(r, "--plot", plot="matched-rate comparison PNG")
    r.set_defaults(func=cmd_predictor)

    c = sub.add_parser("compare-layers", help="linear CKA between every layer of model A and every layer of model B "
                                              "on the same tokens (heat map + JSON)")
    c.add_argument("a", help="model directory A (rows of the matrix)")
    c.add_argument("b", help="model directory B (columns), with the same tokenizer")
    _split(c, "validation", 8192, "compared")
    _inputs_outputs(c, "write the CKA matrix and alignment as JSON", "heat map PNG")
    c.set_defaults(func=cmd_compare_layers)

    w = sub.add_parser("sweep-allocation", help="train MoE+Engram models at one sparse-parameter budget with the "
                                                "Engram share swept; validation loss vs share (does a U appear?)")
    w.add_argument("--out", required=True, help="sweep folder: one run directory per model, sweep.json (finished "
                                                "runs in it are reused, so an interrupted sweep continues)")
    w.add_argument("--shares", type=_csv(lambda v: float(v) / 100), default="0,20,40,60,80",
                   help="Engram shares in percent (default 0,20,40,60,80)")
    w.add_argument("--seeds", type=_csv(int), default="0", help="training seeds, comma separated (default 0)")
    w.add_argument("--tokens", type=_count, default=262144, help="training tokens per model (default 262144)")
    w.add_argument("--d-model", type=int, default=128, help="width (default 128)")
    w.add_argument("--layers", dest="n_layers", type=int, default=4, help="blocks (default 4; MoE in all but block 0)")
    w.add_argument("--max-seq", type=int, default=128, help="training context (default 128)")
    w.add_argument("--experts", dest="experts_at_zero", type=int, default=16,
                   help="routed experts per MoE block at share 0: fixes the budget (default 16)")
    w.add_argument("--expert-ffn", type=int, default=128, help="width of each routed expert (default 128)")
    w.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    w.add_argument("--warmup-steps", type=int, default=20, help="default 20")
    w.add_argument("--eval-tokens", type=int, default=16384, help="validation tokens per category (default 16384)")
    w.add_argument("--controls", type=_csv(str), default="",
                   help="MoE-only controls (each share's experts, no Engram) to train too: tokens (same tokens), "
                        "compute (tokens x the measured step-time ratio), or tokens,compute")
    w.add_argument("--no-train", dest="train", action="store_false",
                   help="train nothing: report the finished runs in OUT")
    w.add_argument("--results", metavar="DIR", help="write the small result files (sweep, controls, engram-off, "
                                                    "equal-compute, power .json) to DIR")
    _inputs_outputs(w, "write the sweep as JSON (it is also in OUT/sweep.json)", "loss vs Engram share PNG")
    w.set_defaults(func=cmd_sweep_allocation)


def _load(args: argparse.Namespace):
    """(model, tokenizer, corpus dir) from the common arguments."""
    import torch  # noqa: F401  (loaded before the model modules)

    from tiergram.corpus import ensure_corpus

    model, tokenizer = load_with_tokenizer(args)
    if not model.engram_layers:
        raise ValueError(f"{args.dir} has no Engram layers to study")
    return model, tokenizer, ensure_corpus(args.corpus, tokenizer=False, progress=not args.quiet)  # built if missing


def _windows(model: Any, tokenizer: Any, corpus: Path, args: argparse.Namespace, tokens: int | None = None,
             split: str | None = None) -> list[Any]:
    """The evaluation windows of --split (or `split`), --max-tokens (or `tokens`) per category; 0: all."""
    from tiergram.analysis.trace import load_windows

    tokens = args.max_tokens if tokens is None else tokens
    return load_windows(model, corpus, split or args.split, tokenizer, tokens or None)[1]


def _trace(model: Any, windows: list[Any], args: argparse.Namespace, null: bool = False) -> Any:
    """The gate trace over windows of the model or (null) of a random-init one of its config (--null-seed)."""
    import torch

    from tiergram.analysis.trace import trace
    from tiergram.model.model import EngramLM

    if null:
        torch.manual_seed(args.null_seed)
        model = EngramLM(model.config, model.hasher).to(next(model.parameters()).device)
    return trace(model, windows, batch_size=args.batch_size, progress=not args.quiet)


def _nonnegative(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")


def _emit(args: argparse.Namespace, report: Any, markdown: str, draw: Callable[[str], Any] | None = None,
          extra: dict[str, Any] | None = None) -> None:
    """Draw --plot with `draw`, write --json (report | extra) and --markdown, or print the markdown."""
    if draw is not None and getattr(args, "plot", None):
        draw(args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report) | (extra or {}), indent=1, default=str) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown)
    else:
        print(markdown)
    for name in ("json", "markdown", "plot", "save"):
        if getattr(args, name, None):
            print(f"wrote {getattr(args, name)}", file=sys.stderr)


def cmd_probe(args: argparse.Namespace) -> int:
    from tiergram.analysis.probe import gate_evidence, probe, to_markdown

    _nonnegative(args, "permutations")
    model, tokenizer, corpus = _load(args)
    windows = _windows(model, tokenizer, corpus, args)
    tr = _trace(model, windows, args)
    report = probe(tr, tokenizer, model=str(args.dir), split=args.split, min_count=args.min_count, top=args.top)
    if args.permutations:
        report.evidence = {name: gate_evidence(t, min_count=args.min_count, permutations=args.permutations)
                           for name, t in (("trained", tr), ("random-init", _trace(model, windows, args, null=True)))}
    _emit(args, report, to_markdown(report))
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from tiergram.analysis.ablate import ablate, reroute, reroute_markdown, to_markdown
    from tiergram.analysis.doctest_task import extract_tasks

    model, tokenizer, corpus = _load(args)
    tasks = [] if args.no_generation and not args.reroute else extract_tasks(corpus)
    if args.reroute:
        report = reroute(model, tokenizer, tasks, batch_size=args.batch_size, model_name=str(args.dir),
                         progress=not args.quiet)
        markdown = reroute_markdown(report)
    else:
        report = ablate(model, _windows(model, tokenizer, corpus, args), tokenizer, tasks, model_name=str(args.dir),
                        split=args.split, batch_size=args.batch_size, max_new=args.max_new, progress=not args.quiet)
        markdown = to_markdown(report)
    _emit(args, report, markdown, extra={"doctest_tasks": [vars(t) for t in tasks]})
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from tiergram.analysis.capacity import analyze, plot, to_markdown

    _nonnegative(args, "resamples")
    model, tokenizer, corpus = _load(args)
    tr = null_tr = None
    if args.gate_tokens:
        gate_windows = _windows(model, tokenizer, corpus, args, args.gate_tokens)
        tr = _trace(model, gate_windows, args)
        null_tr = _trace(model, gate_windows, args, null=True) if args.resamples else None
    report, points = analyze(model, _windows(model, tokenizer, corpus, args), tr, model_name=str(args.dir),
                             split=args.split, null=null_tr, resamples=args.resamples)
    _emit(args, report, to_markdown(report), (lambda path: plot(points, path)) if points else None)
    return 0


def cmd_predictor(args: argparse.Namespace) -> int:
    from tiergram.analysis.skipping import check_settings, plot, skip_study, spread_documents, to_markdown
    from tiergram.analysis.trace import load_windows
    from tiergram.analysis.training_rows import training_rows
    from tiergram.model.evaluate import make_windows

    methods = args.methods if "predictor" in args.methods else ("predictor", *args.methods)
    check_settings(args.rates, methods, args.random_seeds)  # before the model runs, not after the traces
    _nonnegative(args, "train_gate_tokens", "doc_tokens")
    model, tokenizer, corpus = _load(args)
    train = None
    if {"train-rare", "train-gate"} & set(methods):
        train = training_rows(model, args.dir, corpus, gate_tokens=args.train_gate_tokens, progress=not args.quiet)
    fit_split = "validation" if args.split == "test" else "test"  # the predictor is evaluated on held-out text
    if args.doc_tokens:
        docs, _ = load_windows(model, corpus, args.split, tokenizer, None)
        eval_windows = make_windows(spread_documents(docs, args.doc_tokens, args.max_tokens or None),
                                    model.config.max_seq)
    else:
        eval_windows = _windows(model, tokenizer, corpus, args)
    fit = _trace(model, _windows(model, tokenizer, corpus, args, args.fit_tokens, fit_split), args)
    report, predictor = skip_study(model, fit, _trace(model, eval_windows, args), train, rates=args.rates,
                                   methods=methods, random_seeds=args.random_seeds, batch_size=args.batch_size,
                                   sketch_width=args.sketch_width, model_name=str(args.dir),
                                   fit_split=fit_split, eval_split=args.split, progress=not args.quiet)
    if args.save:
        predictor.save(args.save)
    _emit(args, report, to_markdown(report), lambda path: plot(report, path))
    return 0


def cmd_compare_layers(args: argparse.Namespace) -> int:
    from tiergram.analysis.cka import compare_layers, plot, to_markdown
    from tiergram.corpus import ensure_corpus
    from tiergram.model.checkpoint import load_pretrained
    from tiergram.tiers.device import resolve_device

    device = resolve_device(args.device)
    a, tok_a = load_pretrained(args.a, device=device)
    b, tok_b = load_pretrained(args.b, device=device)
    if tok_a is None or tok_b is None or tok_a.to_str() != tok_b.to_str():
        raise ValueError(f"{args.a} and {args.b} must both have the same tokenizer.json (CKA compares the models on "
                         "the same tokens)")
    corpus = ensure_corpus(args.corpus, tokenizer=False, progress=not args.quiet)  # the text, built first if missing
    result = compare_layers(a, b, _windows(a, tok_a, corpus, args), batch_size=args.batch_size, model_a=str(args.a),
                            model_b=str(args.b), split=args.split, progress=not args.quiet)
    _emit(args, result, to_markdown(result), lambda path: plot(result, path))
    return 0


def cmd_sweep_allocation(args: argparse.Namespace) -> int:
    from tiergram.analysis.allocation import AllocationConfig, run_sweep
    from tiergram.analysis.allocation_report import build_report, plot, result_files, to_markdown
    from tiergram.model.checkpoint import write_json

    report = build_report(run_sweep(config_from(AllocationConfig, args), progress=not args.quiet))
    write_json(Path(args.out) / "sweep.json", asdict(report))
    if args.results:
        Path(args.results).mkdir(parents=True, exist_ok=True)
        for name, data in result_files(report).items():
            write_json(Path(args.results) / f"{name}.json", data)
    _emit(args, report, to_markdown(report), lambda path: plot(report, path))
    return 0
