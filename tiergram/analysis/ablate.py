"""Ablation: Engram switched off in prefill only, decode only, both, or neither (teacher-forced loss and doctest
generation); and for MoE models, whether the experts reroute when Engram is off. Definitions: docs/findings.md,
sections 2 and 5."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tiergram.analysis.doctest_task import DoctestTask, answer_of, is_finished
from tiergram.analysis.stats import Estimate, interval, paired_ratio_delta, ratio_estimate, seed_cells, seed_delta
from tiergram.analysis.trace import EngramHooks
from tiergram.corpus import EOT
from tiergram.model.evaluate import Window, eval_batches
from tiergram.model.model import EngramLM


@dataclass(frozen=True)
class Setting:
    """Where Engram is switched off."""

    name: str
    prefill_on: bool
    decode_on: bool


SETTINGS = (Setting("none", True, True), Setting("prefill", False, True), Setting("decode", True, False),
            Setting("both", False, False))


@dataclass
class LossResult:
    """Teacher-forced losses of one setting ("all" documents), all positions and decode positions."""

    setting: str
    all_positions: dict[str, Estimate]
    decode_positions: dict[str, Estimate]
    delta_all: dict[str, Estimate]  # vs "none", paired over documents
    delta_decode: dict[str, Estimate]


@dataclass
class GenerationResult:
    """Exact match of one setting on the doctest tasks."""

    setting: str
    exact_match: Estimate
    mean_generated_tokens: float
    answers: list[str] = field(default_factory=list)


@dataclass
class AblationReport:
    """Both measurements for the four settings; the tables are computed from the per-unit sums."""

    model: str
    split: str
    loss: list[LossResult]
    generation: list[GenerationResult]
    tasks: int
    # the per-unit sums every estimate comes from, so several models' files can be pooled (*_seeds_markdown)
    doc_sums: dict[str, list[list[float]]] = field(default_factory=dict)  # setting -> [all, decode] x documents
    doc_counts: list[list[float]] = field(default_factory=list)  # tokens scored: [all, decode] x documents
    doc_category: list[str] = field(default_factory=list)
    answer_sums: dict[str, list[float]] = field(default_factory=dict)  # setting -> answer-token loss per task
    answer_tokens: list[float] = field(default_factory=list)


def keep_mask(prefill: list[int], t: int, setting: Setting) -> torch.Tensor:
    """Bool [B, T]: True where Engram stays on, for rows whose first prefill[b] positions are the prefill."""
    is_prefill = torch.arange(t)[None, :] < torch.tensor(prefill)[:, None]
    return torch.where(is_prefill, setting.prefill_on, setting.decode_on)


@torch.no_grad()
def setting_losses(model: EngramLM, x: torch.Tensor, y: torch.Tensor, prefill: list[int],
                   setting: Setting) -> torch.Tensor:
    """Per-position next-token loss [B, T] (float64, 0 at padding) with Engram off where the setting says."""
    device = next(model.parameters()).device
    if setting.prefill_on and setting.decode_on:
        logits, _ = model(x.to(device))
    elif not setting.prefill_on and not setting.decode_on:
        logits, _ = model(x.to(device), engram_enabled=False)
    else:
        keep = keep_mask(prefill, x.shape[1], setting).to(device)
        hooks = EngramHooks(record=False, keep={layer: keep for layer in model.engram_layers})
        with hooks.installed(model):
            logits, _ = model(x.to(device))
    loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="none").view(y.shape)
    return loss.double().cpu()


@dataclass
class LossSums:
    """Per-document loss sums of each setting and token counts; row 0: all positions, row 1: decode positions."""

    sums: dict[str, np.ndarray]  # setting -> [2, documents]
    counts: np.ndarray  # [2, documents]
    doc_category: list[str]

    def delta(self, a: str, b: str, row: int = 1) -> dict[str, Estimate]:
        """{"all": loss(b) - loss(a)}, paired over documents."""
        return {"all": paired_ratio_delta(self.sums[a][row], self.sums[b][row], self.counts[row])}

    def results(self) -> list[LossResult]:
        """A LossResult per setting (deltas against the first setting)."""
        base = next(iter(self.sums))
        return [LossResult(name, *({"all": ratio_estimate(sm[k], self.counts[k])} for k in (0, 1)),
                           self.delta(base, name, 0), self.delta(base, name, 1)) for name, sm in self.sums.items()]


@torch.no_grad()
def ablate_loss(model: EngramLM, windows: list[Window], *, batch_size: int = 8, progress: bool = False) -> LossSums:
    """Teacher-forced per-document loss sums of each setting."""
    n_docs = max(w.doc for w in windows) + 1
    doc_category = [""] * n_docs
    for w in windows:
        doc_category[w.doc] = w.category
    sums = {s.name: np.zeros((2, n_docs)) for s in SETTINGS}
    counts = np.zeros((2, n_docs))
    for idx, x, y in eval_batches(model, windows, batch_size, "ablate", progress):
        prefill = [len(windows[i].inputs) // 2 for i in idx]
        decode = ~keep_mask(prefill, x.shape[1], Setting("", True, False)).numpy()
        valid = (y != -100).cpu().numpy()
        docs = [windows[i].doc for i in idx]
        np.add.at(counts[0], docs, valid.sum(1))
        np.add.at(counts[1], docs, (valid & decode).sum(1))
        for s in SETTINGS:
            loss = setting_losses(model, x, y, prefill, s).numpy() * valid
            np.add.at(sums[s.name][0], docs, loss.sum(1))
            np.add.at(sums[s.name][1], docs, (loss * decode).sum(1))
    return LossSums(sums, counts, doc_category)


@torch.no_grad()
def greedy(model: EngramLM, prompt: list[int], max_new: int, setting: Setting, tokenizer: Any,
           eot: int | None, indent: int) -> tuple[list[int], str]:
    """Greedy continuation: prefill with Engram per setting.prefill_on, decode per setting.decode_on."""
    device = next(model.parameters()).device
    logits, past = model(torch.tensor([prompt], device=device), use_cache=True, engram_enabled=setting.prefill_on)
    out: list[int] = []
    for _ in range(max_new):
        token = int(logits[0, -1].argmax())
        if token == eot:
            break
        out.append(token)
        if is_finished(tokenizer.decode(out)) or len(prompt) + len(out) >= model.config.max_seq:
            break
        logits, past = model(torch.tensor([[token]], device=device), past, engram_enabled=setting.decode_on)
    return out, answer_of(tokenizer.decode(out), indent)


def ablate_generation(model: EngramLM, tokenizer: Any, tasks: list[DoctestTask], *, max_new: int = 16,
                      progress: bool = False) -> list[GenerationResult]:
    """Exact match of each setting on the tasks, with task-bootstrap intervals."""
    from tqdm import tqdm

    eot = tokenizer.token_to_id(EOT)
    budget = model.config.max_seq - max_new - 1
    prompts = [([eot] if eot is not None else []) + ids[max(0, len(ids) - budget + 1):]
               for ids in (tokenizer.encode(t.prompt).ids for t in tasks)]
    hits = {s.name: np.zeros(len(tasks)) for s in SETTINGS}
    results = []
    for s in SETTINGS:
        answers, n_gen = [], []
        for k, (t, p) in enumerate(tqdm(list(zip(tasks, prompts, strict=True)), desc=f"generate ({s.name} off)",
                                        disable=not progress)):
            ids, answer = greedy(model, p, max_new, s, tokenizer, eot, t.indent)
            hits[s.name][k] = float(answer == t.expected)
            answers.append(answer)
            n_gen.append(len(ids))
        results.append(GenerationResult(s.name, ratio_estimate(hits[s.name], np.ones(len(tasks))),
                                        float(np.mean(n_gen)), answers=answers))
    return results


def task_ids(tokenizer: Any, task: DoctestTask, budget: int) -> tuple[list[int], list[int]]:
    """(prompt ids with a leading <|endoftext|>, cut to fit the budget; answer ids: newline + indented output)."""
    eot = tokenizer.token_to_id(EOT)
    pad = " " * task.indent
    answer = tokenizer.encode("\n" + "\n".join(pad + line for line in task.expected.split("\n"))).ids
    ids = tokenizer.encode(task.prompt).ids
    keep = max(1, budget - len(answer) - 1)
    return ([eot] if eot is not None else []) + ids[max(0, len(ids) - keep):], answer


def answer_batch(pairs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [B, T] zero-padded, y [B, T] with -100 except at answer tokens, valid bool [B, T]: non-padding inputs)."""
    t = max(len(p) + len(a) for p, a in pairs) - 1
    x = torch.zeros(len(pairs), t, dtype=torch.int64)
    y = torch.full((len(pairs), t), -100, dtype=torch.int64)
    valid = torch.zeros(len(pairs), t, dtype=torch.bool)
    for j, (p, a) in enumerate(pairs):
        seq = torch.tensor(p + a)
        x[j, :len(seq) - 1] = seq[:-1]
        y[j, len(p) - 1:len(seq) - 1] = seq[len(p):]
        valid[j, :len(seq) - 1] = True
    return x, y, valid


@torch.no_grad()
def answer_losses(model: EngramLM, tokenizer: Any, tasks: list[DoctestTask], *,
                  batch_size: int = 8) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({setting: answer-token loss sum per task}, answer tokens per task): prompt = prefill, answer = decode."""
    pairs = [task_ids(tokenizer, t, model.config.max_seq) for t in tasks]
    sums = {s.name: np.zeros(len(tasks)) for s in SETTINGS}
    for b in range(0, len(tasks), batch_size):
        chunk = pairs[b:b + batch_size]
        x, y, _ = answer_batch(chunk)
        for s in SETTINGS:
            sums[s.name][b:b + len(chunk)] = setting_losses(model, x, y, [len(p) for p, _ in chunk], s).numpy().sum(1)
    return sums, np.array([len(a) for _, a in pairs], dtype=np.float64)


def ablate(model: EngramLM, windows: list[Window], tokenizer: Any, tasks: list[DoctestTask], *,
           model_name: str = "", split: str = "", batch_size: int = 8, max_new: int = 16,
           progress: bool = False) -> AblationReport:
    """Both measurements for the four settings."""
    sums = ablate_loss(model, windows, batch_size=batch_size, progress=progress)
    gen = ablate_generation(model, tokenizer, tasks, max_new=max_new, progress=progress) if tasks else []
    report = AblationReport(model=model_name, split=split, loss=sums.results(), generation=gen, tasks=len(tasks),
                            doc_sums={name: sm.tolist() for name, sm in sums.sums.items()},
                            doc_counts=sums.counts.tolist(), doc_category=sums.doc_category)
    if tasks:
        asums, acounts = answer_losses(model, tokenizer, tasks, batch_size=batch_size)
        report.answer_sums, report.answer_tokens = {k: v.tolist() for k, v in asums.items()}, acounts.tolist()
    return report


def to_markdown(report: AblationReport) -> str:
    """The ablation tables of one model: the seed tables below with one seed."""
    run = asdict(report)
    lines = [f"# Engram ablation: {report.model}", "",
             f"Split `{report.split}`; each window's first half is the prefill, its second half the decode. Loss in "
             "nats/token, 95% document-bootstrap intervals; Δ against \"none\", paired.", "",
             loss_seeds_markdown([run])]
    if report.generation:
        lines += [f"## Generation: {report.tasks} stdlib doctest outputs (held-out splits)", "",
                  "Greedy, exact match; answer loss teacher-forced, prompt as prefill (intervals over tasks).", "",
                  generation_seeds_markdown([run])]
    return "\n".join(lines)


# ------------------------------------------------------------------------ several models (e.g. training seeds)


def _same(runs: list[dict[str, Any]], key: str) -> np.ndarray:
    """runs[i][key], which must be equal in every result file (the same documents or tasks were scored)."""
    first = np.asarray(runs[0][key], dtype=np.float64)
    if any(not np.array_equal(np.asarray(r[key], dtype=np.float64), first) for r in runs[1:]):
        raise ValueError(f"the ablation results differ in {key!r}: they did not score the same documents and tasks")
    return first


def _seed_cells(sums_a: list[np.ndarray], sums_b: list[np.ndarray], counts: np.ndarray) -> str:
    return seed_cells(*seed_delta(sums_a, sums_b, counts))


_SEED_HEAD = "Δ vs none, seed mean | per seed | over seeds (t 95%) |"
NAMES = {"none": "none (plain)", "prefill": "prefill only", "decode": "decode only", "both": "both (no Engram)"}


def loss_seeds_markdown(runs: list[dict[str, Any]]) -> str:
    """The loss table of several `tiergram ablate --json` results on the same documents (seed mean, per seed)."""
    counts = _same(runs, "doc_counts")
    lines = ["| Engram off in | positions scored | loss, seed mean | " + _SEED_HEAD, "|---|---|---|---|---|---|"]
    for row, where in ((1, "decode"), (0, "all")):
        sums = {s.name: [np.asarray(r["doc_sums"][s.name][row]) for r in runs] for s in SETTINGS}
        for s in SETTINGS:
            cells = "0 | – | –" if s.name == "none" else _seed_cells(sums["none"], sums[s.name], counts[row])
            loss = interval(ratio_estimate(np.mean(sums[s.name], 0), counts[row]), ".4f")
            lines.append(f"| {NAMES[s.name]} | {where} | {loss} | {cells} |")
        if row == 1:
            lines.append("| prefill only − decode only | decode | – | "
                         f"{_seed_cells(sums['decode'], sums['prefill'], counts[1])} |")
    return "\n".join(lines) + "\n"


def generation_seeds_markdown(runs: list[dict[str, Any]]) -> str:
    """The doctest table of several ablation results on the same tasks (seed mean, per seed)."""
    counts, tasks = _same(runs, "answer_tokens"), int(_same(runs, "tasks"))
    gen = [{g["setting"]: g for g in r["generation"]} for r in runs]
    sums = {s.name: [np.asarray(r["answer_sums"][s.name]) for r in runs] for s in SETTINGS}
    lines = ["| Engram off in | exact match, per seed | mean generated tokens, per seed | answer loss, seed mean | "
             + _SEED_HEAD, "|---|---|---|---|---|---|---|"]
    for s in SETTINGS:
        exact = ", ".join(f"{round(g[s.name]['exact_match']['value'] * tasks)}/{tasks}" for g in gen)
        generated = ", ".join(f"{g[s.name]['mean_generated_tokens']:.1f}" for g in gen)
        cells = "0 | – | –" if s.name == "none" else _seed_cells(sums["none"], sums[s.name], counts)
        loss = interval(ratio_estimate(np.mean(sums[s.name], 0), counts), ".4f")
        lines.append(f"| {NAMES[s.name]} | {exact} | {generated} | {loss} | {cells} |")
    lines.append(f"| prefill only − decode only | | | – | {_seed_cells(sums['decode'], sums['prefill'], counts)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- experts that reroute (MoE)

LN2 = float(np.log(2.0))


@dataclass
class RerouteReport:
    """Doctest answer loss with Engram on, off, off with the on run's experts forced; routing changes."""

    model: str
    tasks: int
    answer_tokens: int
    moe_layers: list[int]
    loss: dict[str, Estimate]  # bits per answer token, intervals over tasks
    delta_vs_on: dict[str, Estimate]  # paired over tasks
    forced_minus_off: dict[str, Estimate]  # loss(off, forced) - loss(off, free routing), paired
    changed_sets: dict[str, Estimate]  # per MoE block and "all": share of tokens whose set of top-k experts changes
    changed_assignments: dict[str, Estimate]  # share of (token, expert) assignments that change


@torch.no_grad()
def reroute(model: EngramLM, tokenizer: Any, tasks: list[DoctestTask], *, batch_size: int = 8, model_name: str = "",
            progress: bool = False) -> RerouteReport:
    """The reroute ablation on the tasks' teacher-forced answers (prompt = the code, answer = its output)."""
    from tqdm import tqdm

    from tiergram.model.moe import moe_layers, routing

    model.eval()
    device = next(model.parameters()).device
    layers = moe_layers(model)
    blocks = sorted(layers)
    if not blocks or not model.engram_layers:
        raise ValueError("the reroute ablation needs a model with both MoE blocks and Engram layers "
                         "(e.g. `tiergram train --config small-moe`)")
    if not tasks:
        raise ValueError("no doctest tasks to score")
    k = layers[blocks[0]].top_k
    names = ["on", "off", "off, forced all", *[f"off, forced block {b}" for b in blocks]]
    sums = {n: np.zeros(len(tasks)) for n in names}
    counts = np.zeros(len(tasks))
    moved = {str(b): np.zeros((2, len(tasks))) for b in blocks}  # row 0: sets changed, row 1: assignments changed
    positions = np.zeros(len(tasks))
    pairs = [task_ids(tokenizer, t, model.config.max_seq) for t in tasks]

    def bits(x: torch.Tensor, y: torch.Tensor, engram: bool) -> np.ndarray:
        return setting_losses(model, x, y, [], SETTINGS[0 if engram else -1]).numpy().sum(1) / LN2

    for b0 in tqdm(range(0, len(tasks), batch_size), desc="reroute", unit="batch", disable=not progress):
        sl = slice(b0, b0 + len(pairs[b0:b0 + batch_size]))
        x, y, valid = answer_batch(pairs[sl])
        counts[sl] = (y != -100).sum(1).numpy()
        positions[sl] = valid.sum(1).numpy()
        with routing(model, record=True) as mods:
            sums["on"][sl] = bits(x, y, True)
            on = {b: mods[b].last_choices.cpu() for b in blocks}
            sums["off"][sl] = bits(x, y, False)
            off = {b: mods[b].last_choices.cpu() for b in blocks}
        with routing(model, force={b: c.to(device) for b, c in on.items()}):
            sums["off, forced all"][sl] = bits(x, y, False)
        for b in blocks:
            with routing(model, force={b: on[b].to(device)}):
                sums[f"off, forced block {b}"][sl] = bits(x, y, False)
            same = (on[b].unsqueeze(-1) == off[b].unsqueeze(-2)).any(-1)  # [B, T, k]: on's expert also chosen off
            moved[str(b)][0, sl] = ((~same.all(-1)) & valid).sum(1).numpy()
            moved[str(b)][1, sl] = ((~same).sum(-1) * valid).sum(1).numpy() / k
    moved["all"] = sum(moved[str(b)] for b in blocks)
    per = {key: positions * (len(blocks) if key == "all" else 1) for key in moved}
    return RerouteReport(
        model=model_name, tasks=len(tasks), answer_tokens=int(counts.sum()), moe_layers=blocks,
        loss={n: ratio_estimate(sums[n], counts) for n in names},
        delta_vs_on={n: paired_ratio_delta(sums["on"], sums[n], counts) for n in names[1:]},
        forced_minus_off={n: paired_ratio_delta(sums["off"], sums[n], counts) for n in names[2:]},
        changed_sets={key: ratio_estimate(m[0], per[key]) for key, m in moved.items()},
        changed_assignments={key: ratio_estimate(m[1], per[key]) for key, m in moved.items()})


def reroute_verdict(report: RerouteReport) -> str:
    """One sentence: does forcing the Engram-on routing make the ablated model worse (routing compensates)?"""
    d = report.forced_minus_off["off, forced all"]
    head = (f"Engram off changes the answer loss by {interval(report.delta_vs_on['off'])} bits/token; forcing the "
            f"Engram-on expert choices changes it by a further {interval(d)}")
    if d.ci95[0] > 0:
        return head + ": the experts' rerouting partly compensates for the missing memory"
    return head + (": no compensation" if d.ci95[1] < 0 else ", within noise")


def reroute_markdown(report: RerouteReport) -> str:
    """The reroute ablation as markdown."""
    lines = [f"# Experts that reroute: {report.model}", "",
             f"{report.tasks} stdlib doctest tasks ({report.answer_tokens} answer tokens), teacher-forced. Answer loss "
             "in bits/token, 95% intervals over tasks; forced = the MoE blocks' top-k experts set to those the "
             "Engram-on forward chose.", "", "| setting | answer loss | Δ vs on | Δ vs off |", "|---|---|---|---|"]
    for name, est in report.loss.items():
        dv = "0" if name == "on" else interval(report.delta_vs_on[name])
        do = interval(report.forced_minus_off[name]) if name in report.forced_minus_off else ""
        lines.append(f"| {name} | {interval(est, '.4f')} | {dv} | {do} |")
    lines += ["", "Routing decisions that change when Engram is off (all non-padding positions):", "",
              "| MoE block | top-k set changed | assignments changed |", "|---|---|---|"]
    for key in report.changed_sets:
        lines.append(f"| {key} | {interval(report.changed_sets[key], '.4f')} | "
                     f"{interval(report.changed_assignments[key], '.4f')} |")
    return "\n".join(lines + ["", f"**{reroute_verdict(report)}.**", ""])
