"""`tiergram plan`: predict each placement's serving front from hardware and model specs; calibrate this machine;
validate a prediction against a measured `tiergram bench serve` sweep. See docs/planner.md."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tiergram.cli.common import add_common

USAGE = """tiergram plan MODEL HARDWARE [options]     predict the fronts (table + PNG)
       tiergram plan calibrate [--model DIR | --measured JSON] [--out SPEC.toml]
       tiergram plan validate SWEEP_JSON --hardware SPEC [--model MODEL] [--json]
       tiergram plan studies [--out DIR] [--model-dir DIR]   the predictions of docs/planner.md, with plots

MODEL: a model spec name or .toml (shipped: deepseek-v4.1-flash) or a trained model directory.
HARDWARE: a hardware spec name or .toml (shipped: h200, b200, gb300; `this-machine` after calibrate)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict each placement's throughput/interactivity front from hardware and model "
                                    "specs (also: plan calibrate, validate, studies)", usage=USAGE, add_help=False)
    p.add_argument("-h", "--help", action="store_true", dest="plan_help", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_plan)


def _predict_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiergram plan", description="Predict each placement's serving front.")
    p.add_argument("model", help="model spec name, .toml, or a trained model directory")
    p.add_argument("hardware", help="hardware spec name or .toml (`this-machine` after `tiergram plan calibrate`)")
    p.add_argument("--input-len", type=float, default=8192, help="mean prompt tokens (default 8192)")
    p.add_argument("--output-len", type=float, default=1024, help="mean output tokens (default 1024)")
    p.add_argument("--max-num-seqs", type=int, default=4096, help="the engine's sequence cap (default 4096)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="tokens per step (default 16384)")
    p.add_argument("--cache-fractions", default="0.01,0.1",
                   help="file placement host caches, as fractions of the table (default 0.01,0.1)")
    p.add_argument("--prompt-rows-first", action="store_true",
                   help="file placements: steps wait only for decode rows (default: for all their rows)")
    p.add_argument("--hot-rows", action="store_true",
                   help="also each file placement with its cache preloaded with hot rows (the engine's --hot-rows)")
    add_common(p, "--plot", "--json", plot="PNG path (default: plan-MODEL-HARDWARE.png in the cache)",
               json="print JSON instead of the table")
    return p


def _calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiergram plan calibrate",
                                description="Measure this machine briefly and write the hardware spec fitted from it.")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="the trained model to calibrate on, the one you will predict (default: the demo's)")
    p.add_argument("--out", default=None, help="spec path (default: this-machine.toml in the cache); the "
                                               "measurements go beside it as NAME.measured.json")
    p.add_argument("--no-serve", action="store_true", help="skip the HTTP-path measurement (a server's closed loop)")
    p.add_argument("--measured", default=None, metavar="JSON",
                   help="fit the spec from measurements an earlier calibrate kept, without measuring again")
    return p


def _validate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiergram plan validate",
                                description="Compare a measured `bench serve` sweep with the prediction.")
    p.add_argument("sweep_json", help="the JSON `tiergram bench serve --json` / `tiergram demo` wrote")
    p.add_argument("--hardware", required=True, help="hardware spec (e.g. this-machine)")
    p.add_argument("--model", default=None, help="model spec or directory (default: the sweep's model_dir)")
    p.add_argument("--host-traffic-gbps", type=float, default=0.0,
                   help="other traffic through host memory during the sweep, GB/s (`python -m tiergram.bench.stream`)")
    p.add_argument("--prompt-rows-first", choices=("auto", "on", "off"), default="auto",
                   help="whether the file servers ran with prompt_rows_first (auto: from the sweep's config)")
    p.add_argument("--disk", choices=("sweep", "spec"), default="sweep",
                   help="predict file servers on the disk limit the sweep measured on their tables, or the spec's")
    p.add_argument("--speed", choices=("sweep", "spec"), default="sweep",
                   help="predict at the median of the sweep's CPU speed probes, or at the spec's")
    p.add_argument("--hit-rates", default=None, metavar="JSON",
                   help="the file tier's hit rates from a `bench cache --capacity-of table --json` run")
    p.add_argument("--naive", action="store_true",
                   help="also the naive baseline (calibration's own server's throughput at each concurrency)")
    add_common(p, "--plot", "--json", plot="PNG of the predicted points (lines) with the measured ones",
               json="print JSON instead of the table")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead")
    return p


def _studies_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiergram plan studies", description="The predictions of docs/planner.md.")
    p.add_argument("--out", default=None, help="folder for the PNGs and studies.md (default: the cache)")
    p.add_argument("--model-dir", default=None,
                   help="the model whose top-k hit rate stands in for a real model's (default: the demo's, if cached)")
    return p


def _studies(a: argparse.Namespace) -> int:
    from tiergram.paths import cache_dir
    from tiergram.plan.studies import run

    out = Path(a.out) if a.out else cache_dir("plan") / "studies"
    model_dir = a.model_dir
    if model_dir is None and (cache_dir("models") / "demo-small" / "config.json").is_file():
        model_dir = str(cache_dir("models") / "demo-small")
    md = run(out, model_dir)
    (out / "studies.md").write_text(md)
    print(md)
    print(f"plots and studies.md in {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    if args.plan_help or not rest or rest[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if rest or args.plan_help else 2
    subcommands = {"calibrate": (_calibrate_parser, _calibrate), "validate": (_validate_parser, _validate),
                   "studies": (_studies_parser, _studies)}
    if rest[0] in subcommands:
        parser, run = subcommands[rest[0]]
        return run(parser().parse_args(rest[1:]))
    return _predict(_predict_parser().parse_args(rest))


def _predict(a: argparse.Namespace) -> int:
    from tiergram.paths import cache_dir
    from tiergram.plan import predict
    from tiergram.plan.model import Workload, predict_front
    from tiergram.plan.specs import load_hardware, load_model

    model, hw = load_model(a.model), load_hardware(a.hardware)
    try:
        fractions = tuple(float(x) for x in a.cache_fractions.split(",") if x)
    except ValueError:
        raise ValueError(f"--cache-fractions must be comma-separated numbers, got {a.cache_fractions!r}") from None
    wl = Workload(input_len=a.input_len, output_len=a.output_len, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.max_num_batched_tokens, prompt_rows_first=a.prompt_rows_first)
    fronts = [predict_front(model, hw, wl, pl) for pl in predict.placements(fractions, hot_rows=a.hot_rows)]
    path = Path(a.plot) if a.plot else cache_dir("plan") / f"plan-{Path(str(a.model)).stem}-{Path(a.hardware).stem}.png"
    title = f"PREDICTED: {model.name} on {hw.name}\ninput {wl.input_len:g} / output {wl.output_len:g} tokens"
    png = predict.plot({f.placement.label: [(p.interactivity, p.throughput_tok_s) for p in f.pareto]
                        for f in fronts if f.points}, path, title)
    if a.json:
        print(predict.to_json(model, hw, wl, fronts))
    else:
        print(predict.to_text(model, hw, wl, fronts))
        print(f"plot: {png}")
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    from tiergram.paths import cache_dir
    from tiergram.plan.calibrate import fit, read_measurements, summary, to_toml
    from tiergram.plan.specs import calibrated_path, load_hardware

    out = Path(a.out) if a.out else calibrated_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.measured:
        if a.model:
            raise ValueError("plan calibrate --measured fits the measurements' own model: give no --model")
        measured = Path(a.measured)
        raw = read_measurements(measured)
    else:
        from tiergram.bench.calibrate import measure

        model_dir = a.model or str(cache_dir("models") / "demo-small")
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"{model_dir}: no trained model there (run `tiergram demo` once, or pass a model "
                             "directory)")
        raw = measure(model_dir, serve=not a.no_serve)
        measured = out.with_name(out.stem + ".measured.json")
        measured.write_text(json.dumps(raw, indent=1))
    cal = fit(raw)
    print(summary(cal))
    out.write_text(to_toml(cal))
    load_hardware(out)  # what was written must load
    print(f"wrote {out} (fitted from {measured})")
    return 0


def _validate(a: argparse.Namespace) -> int:
    from tiergram.plan import predict
    from tiergram.plan.specs import load_hardware, load_model, with_hit_rates

    sweep = predict.read_sweep(Path(a.sweep_json))
    model = load_model(a.model or sweep["config"]["model_dir"])
    if a.hit_rates:
        model = with_hit_rates(model, Path(a.hit_rates))
    hw = load_hardware(a.hardware)
    rows_first = {"auto": None, "on": True, "off": False}[a.prompt_rows_first]
    res = predict.validate(sweep, model, hw, a.host_traffic_gbps * 1e9, rows_first=rows_first,
                           disk_from=a.disk, speed_from=a.speed, naive=a.naive)
    if a.plot:  # each server's points as validate predicted them, beside the measured ones
        lines: dict[str, list[tuple[float, float]]] = {}
        measured: dict[str, list[tuple[float, float]]] = {}
        for r in res["points"]:
            lines.setdefault(r["placement"], []).append((r["predicted_interactivity"], r["predicted_tok_s"]))
            if r["measured_interactivity"] is not None:
                measured.setdefault(r["placement"], []).append((r["measured_interactivity"], r["measured_tok_s"]))
        predict.plot(lines, Path(a.plot), f"{model.name} on {hw.name}: predicted (lines) vs measured (x)", measured)
    if a.json:
        print(json.dumps(res, indent=2))
    elif a.markdown:
        print(predict.validate_markdown(res))
    else:
        print(predict.validate_text(res))
    return 0
