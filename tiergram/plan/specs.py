"""Hardware and model specs: small TOML files, validated field by field, every figure with its source
(docs/planner.md, "Specs"); a model may also be a trained model directory."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tomllib

from tiergram.hashing import engram_head_table_sizes
from tiergram.plan.model import DiskSpec, EngramGeometry, HardwareSpec, ModelSpec, MoeGeometry

SPEC_DIR = Path(__file__).parent / "specs"
GB = 1e9


class SpecError(ValueError):
    """A spec file that cannot be used: the message names the file, the field and the problem."""


@dataclass(frozen=True)
class Field:
    """One TOML field: how to read it into the dataclass."""

    key: str  # name in the file
    attr: str  # dataclass attribute
    scale: float = 1.0  # file unit -> dataclass unit
    required: bool = True
    kind: str = "number"  # number | int | str | curve | ints | counts (an integer > 0, or a list of them)
    positive: bool = False  # numbers must be > 0 (else >= 0)


HARDWARE_FIELDS = (
    Field("name", "name", kind="str"),
    Field("kind", "kind", kind="str"),
    Field("device_memory_gb", "device_memory_bytes", GB, positive=True),
    Field("device_bw_gbps", "device_bw", GB, positive=True),
    Field("compute_tflops", "compute_flops", 1e12, positive=True),
    Field("step_overhead_us", "step_overhead_s", 1e-6),
    Field("per_seq_us", "per_seq_s", 1e-6),
    Field("per_token_us", "per_token_s", 1e-6, required=False),
    Field("request_overhead_ms", "request_overhead_s", 1e-3, required=False),
    Field("host_memory_gb", "host_memory_bytes", GB, positive=True),
    Field("host_bw_gbps", "host_bw", GB, positive=True),
    Field("gather_mrows_s", "gather_rows_s", 1e6, positive=True),
    Field("gather_call_us", "gather_call_s", 1e-6, required=False),
    Field("file_gather_mrows_s", "file_gather_rows_s", 1e6, required=False),
    Field("file_call_us", "file_call_s", 1e-6, required=False),
    Field("link_gbps", "link_bw", GB),
    Field("cores", "cores", kind="int", required=False),
    Field("cpu_speed_ms", "cpu_speed_ms", 1.0, required=False),
    Field("server_step_curve", "server_step_curve", kind="curve", required=False),
    Field("request_steps_curve", "request_steps_curve", kind="curve", required=False),
    Field("serve_tok_s_curve", "serve_tok_s_curve", kind="curve", required=False),
)
DISK_FIELDS = (
    Field("drives", "drives", kind="int", positive=True),
    Field("page_bytes", "page_bytes", kind="int", positive=True, required=False),
    Field("cpu_us_per_page", "cpu_s_per_page", 1e-6),
    Field("threads", "threads", kind="int", positive=True, required=False),
    Field("iops_curve", "iops_curve", kind="curve"),
    Field("cache_pages_per_s", "cache_pages_per_s", required=False),
)
MODEL_FIELDS = (
    Field("name", "name", kind="str"),
    Field("n_layers", "n_layers", kind="int", positive=True),
    Field("active_params_b", "active_params", 1e9, positive=True),
    Field("weight_gb", "weight_bytes", GB, positive=True),
    Field("active_weight_gb", "active_weight_bytes", GB, positive=True),
    Field("kv_bytes_per_token", "kv_bytes_per_token", positive=True),
    Field("activation_gb", "activation_bytes", GB, required=False),
    Field("hit_rate_curve", "hit_rate_curve", kind="curve", required=False),
    Field("hot_hit_rate_curve", "hot_hit_rate_curve", kind="curve", required=False),
    Field("prefill_active_params_b", "prefill_active_params", 1e9, positive=True, required=False),
    Field("kv_state_bytes_per_seq", "kv_state_bytes_per_seq", required=False),
)
MOE_FIELDS = (
    Field("experts", "experts", kind="int", positive=True),
    Field("experts_per_token", "experts_per_token", kind="int", positive=True),
    Field("layers", "layers", kind="int", positive=True),
    Field("expert_mb", "expert_bytes", 1e6, positive=True),
    Field("prefill_layers", "prefill_layers", kind="int", positive=True, required=False),
)
ENGRAM_FIELDS = (
    Field("layers", "layers", kind="ints"),
    Field("heads", "heads", kind="int", positive=True),
    Field("row_bytes", "row_bytes", kind="int", positive=True),
    Field("rows_per_layer", "rows_per_layer", kind="counts", positive=True),
)


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec: {e.strerror}") from None


def _value(path: Path, table: str, f: Field, raw: Any) -> Any:
    where = f"{path}: [{table}] field `{f.key}`"
    if f.kind == "str":
        if not isinstance(raw, str) or not raw:
            raise SpecError(f"{where}: expected a non-empty string, got {raw!r}")
        return raw
    if f.kind == "ints" or (f.kind == "counts" and isinstance(raw, list)):
        low = 0 if f.kind == "ints" else 1
        if not isinstance(raw, list) or not raw or not all(_is_number(x) and isinstance(x, int) and x >= low
                                                            for x in raw):
            raise SpecError(f"{where}: expected a non-empty list of integers >= {low}, got {raw!r}")
        return tuple(raw)
    if f.kind == "curve":
        ok = isinstance(raw, list) and raw and all(
            isinstance(p, list) and len(p) == 2 and all(_is_number(x) for x in p) for p in raw)
        if not ok:
            raise SpecError(f"{where}: expected a list of [x, y] number pairs, got {raw!r}")
        pts = tuple((float(x), float(y)) for x, y in raw)
        if any(x <= 0 or y < 0 for x, y in pts):
            raise SpecError(f"{where}: x must be > 0 and y >= 0 in every pair, got {raw!r}")
        if [x for x, _ in pts] != sorted({x for x, _ in pts}):
            raise SpecError(f"{where}: x must increase strictly from pair to pair, got {raw!r}")
        return pts
    integer = f.kind in ("int", "counts")
    if not _is_number(raw) or (integer and not float(raw).is_integer()):
        what = "an integer" if integer else "a number"
        raise SpecError(f"{where}: expected {what}, got {raw!r}")
    v = float(raw)
    if not math.isfinite(v) or v < 0 or (f.positive and v <= 0):
        raise SpecError(f"{where}: must be {'> 0' if f.positive else '>= 0'} and finite, got {raw!r}")
    return int(v) if integer else v * f.scale


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _fields(path: Path, table: str, obj: Any, fields: tuple[Field, ...], sources: dict[str, Any],
            prefix: str = "", sub: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise SpecError(f"{path}: [{table}] must be a table")
    known = {f.key for f in fields} | set(sub)
    unknown = sorted(set(obj) - known)
    if unknown:
        raise SpecError(f"{path}: [{table}] has unknown field(s) {unknown} (known: {sorted(known)})")
    out = {}
    for f in fields:
        if f.key not in obj:
            if f.required:
                raise SpecError(f"{path}: [{table}] misses the required field `{f.key}`")
            continue
        out[f.attr] = _value(path, table, f, obj[f.key])
        if f.kind != "str" and f"{prefix}{f.key}" not in sources:
            raise SpecError(f"{path}: [sources] has no entry for `{prefix}{f.key}`: every figure says where it "
                            "comes from (a datasheet or paper, 'measured by ...', or 'assumed: why')")
    return out


def _sources(path: Path, data: dict[str, Any]) -> dict[str, str]:
    src = data.get("sources", {})
    if not isinstance(src, dict) or not all(isinstance(v, str) and v.strip() for v in src.values()):
        raise SpecError(f"{path}: [sources] must map field names to non-empty strings")
    return src


def _load(spec: str | Path, what: str, other: str) -> tuple[Path, dict[str, Any], dict[str, str]]:
    """(path, its [what] table, its [sources]) of a spec argument."""
    path = resolve(spec, what)
    data = _read(path)
    if what not in data:
        raise SpecError(f"{path}: no [{what}] table (is this a {other} spec?)")
    return path, data[what], _sources(path, data)


def _sub(path: Path, obj: Any, table: str, key: str, fields: tuple[Field, ...], sources: dict[str, Any]
         ) -> dict[str, Any]:
    """The fields of the [table.key] table."""
    if key not in obj:
        raise SpecError(f"{path}: [{table}] misses the [{table}.{key}] table")
    return _fields(path, f"{table}.{key}", obj[key], fields, sources, prefix=f"{key}.")


def load_hardware(spec: str | Path) -> HardwareSpec:
    """A hardware spec from a TOML file or a spec name; SpecError names the file, field and problem."""
    path, obj, sources = _load(spec, "hardware", "model")
    hw = _fields(path, "hardware", obj, HARDWARE_FIELDS, sources, sub=("disk",))
    if hw["kind"] not in ("gpu", "cpu"):
        raise SpecError(f"{path}: [hardware] field `kind`: must be 'gpu' or 'cpu', got {hw['kind']!r}")
    if hw["kind"] == "gpu" and hw["link_bw"] <= 0:
        raise SpecError(f"{path}: [hardware] field `link_gbps`: a gpu needs a host link > 0")
    return HardwareSpec(**hw, disk=DiskSpec(**_sub(path, obj, "hardware", "disk", DISK_FIELDS, sources)))


def load_model(spec: str | Path) -> ModelSpec:
    """A model spec from a TOML file, a spec name, or a trained model directory."""
    if Path(spec).is_dir():
        return model_from_dir(Path(spec))
    path, obj, sources = _load(spec, "model", "hardware")
    m = _fields(path, "model", obj, MODEL_FIELDS, sources, sub=("engram", "moe"))
    e = _sub(path, obj, "model", "engram", ENGRAM_FIELDS, sources)
    if max(e["layers"]) >= m["n_layers"]:
        raise SpecError(f"{path}: [model.engram] field `layers`: {list(e['layers'])} must lie in "
                        f"0..{m['n_layers'] - 1} (n_layers = {m['n_layers']})")
    rows = e["rows_per_layer"]
    if isinstance(rows, tuple) and len(rows) != len(e["layers"]):
        raise SpecError(f"{path}: [model.engram] field `rows_per_layer`: {len(rows)} counts for "
                        f"{len(e['layers'])} layers {list(e['layers'])}")
    if m["active_weight_bytes"] > m["weight_bytes"]:
        raise SpecError(f"{path}: [model] field `active_weight_gb`: larger than weight_gb")
    if "moe" in obj:
        m["moe"] = _moe(path, _sub(path, obj, "model", "moe", MOE_FIELDS, sources), m)
    for field in ("hit_rate_curve", "hot_hit_rate_curve"):
        for name, v in m.get(field, ()):
            if v > 1:
                raise SpecError(f"{path}: [model] field `{field}`: hit rate {v} at {name} is above 1")
    return ModelSpec(**m, engram=EngramGeometry(**e))


def _moe(path: Path, f: dict[str, Any], m: dict[str, Any]) -> MoeGeometry:
    """The [model.moe] table, checked against the model's blocks and weights."""
    moe = MoeGeometry(**f)
    where = f"{path}: [model.moe]"
    if moe.experts_per_token > moe.experts:
        raise SpecError(f"{where} field `experts_per_token`: {moe.experts_per_token} of {moe.experts} experts")
    if moe.layers > m["n_layers"] or moe.prefill_layers > moe.layers:
        raise SpecError(f"{where} field `layers`/`prefill_layers`: need prefill_layers <= layers <= n_layers, got "
                        f"{moe.prefill_layers}, {moe.layers}, {m['n_layers']}")
    if moe.experts_per_token * moe.layers * moe.expert_bytes > m["active_weight_bytes"]:
        raise SpecError(f"{where} field `expert_mb`: a token's experts outweigh active_weight_gb")
    if moe.experts * moe.layers * moe.expert_bytes > m["weight_bytes"]:
        raise SpecError(f"{where} field `expert_mb`: all experts outweigh weight_gb")
    return moe


def resolve(spec: str | Path, what: str) -> Path:
    """The TOML file a spec argument names: a path, a shipped spec, or the calibrated one in the cache."""
    p = Path(spec)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise SpecError(f"{p}: no such {what} spec file")
        return p
    for cand in (SPEC_DIR / f"{spec}.toml", calibrated_path() if str(spec) == "this-machine" else None):
        if cand is not None and cand.is_file():
            return cand
    if str(spec) == "this-machine":
        raise SpecError(f"no calibrated spec at {calibrated_path()}: run `tiergram plan calibrate` first")
    raise SpecError(f"no {what} spec named {spec!r} (shipped: {', '.join(shipped())}; or a .toml path)")


def calibrated_path() -> Path:
    """Where `tiergram plan calibrate` writes this machine's spec by default."""
    from tiergram.paths import cache_dir

    return cache_dir("plan") / "this-machine.toml"


def shipped() -> list[str]:
    """Names of the specs that ship with tiergram."""
    return sorted(x.stem for x in SPEC_DIR.glob("*.toml"))


# ------------------------------------------------------------------------------------ a trained model dir

def model_from_dir(model_dir: Path) -> ModelSpec:
    """The spec of a trained tiergram model: counted weights, K/V and activation bytes, fp8 tables' geometry."""
    from tiergram.engine.budget import activation_bytes, kv_block_bytes
    from tiergram.engine.config import EngineConfig
    from tiergram.model.checkpoint import read_config
    from tiergram.model.config import ModelConfig
    from tiergram.model.model import EngramLM

    try:
        cfg_obj = read_config(str(model_dir))
    except (OSError, ValueError, KeyError) as e:
        raise SpecError(f"{model_dir}: not a tiergram model directory ({e})") from None
    cfg = ModelConfig.from_dict(cfg_obj["model"])
    e = cfg.engram
    if e is None:
        raise SpecError(f"{model_dir}: the model has no Engram layers: nothing to place")
    import torch

    with torch.device("meta"):
        lm = EngramLM(cfg)
    weights = lm.num_params()["backbone"]  # the engine runs float32 on a CPU: 4 bytes each
    # an embedding lookup multiplies nothing (a tied LM head multiplies the same weights); a token runs top_k experts
    active = weights - lm.tok_emb.weight.numel() + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)
    if cfg.moe is not None:
        m = cfg.moe
        active -= len(m.layers) * (m.n_experts - m.top_k) * 3 * cfg.d_model * m.expert_ffn
    kv = kv_block_bytes(cfg, 1, torch.float32)  # K, V and the short conv's paged input, as the engine sizes them
    act = activation_bytes(cfg, max_num_batched_tokens=EngineConfig.max_num_batched_tokens,
                           max_num_seqs=EngineConfig.max_num_seqs, max_model_len=cfg.max_seq, dtype=torch.float32)
    sizes = engram_head_table_sizes(e.engram_vocab_size, e.max_ngram_size, e.n_head_per_ngram, e.layers)
    rows = tuple(sum(map(sum, sizes[layer])) for layer in sorted(e.layers))  # each layer's heads end to end
    row_bytes = e.dim + e.dim // 32  # one byte per value and one E8M0 scale per 32 values
    return ModelSpec(name=model_dir.name, n_layers=cfg.n_layers, active_params=float(active),
                     weight_bytes=float(weights * 4), active_weight_bytes=float(active * 4),
                     kv_bytes_per_token=float(kv), engram=EngramGeometry(tuple(sorted(e.layers)), e.n_heads,
                                                                          row_bytes, rows),
                     activation_bytes=float(act))


def with_hit_rates(model: ModelSpec, path: Path) -> ModelSpec:
    """The model with the lru and lru-hot hit-rate curves of a `tiergram bench cache --capacity-of table --json` run."""
    try:
        res = json.loads(Path(path).read_text())
        rates, of = res["hit_rate"], res["config"]["capacity_of"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{path}: not a `tiergram bench cache --json` result ({e})") from None
    if of != "table":
        raise SpecError(f"{path}: capacities are fractions of the rows touched; the planner needs fractions of the "
                        "table (`bench cache --capacity-of table`)")
    if "lru" not in rates:
        raise SpecError(f"{path}: no lru hit rates (`bench cache --policies lru lru-hot`)")

    def curve(policy: str) -> tuple[tuple[float, float], ...]:
        return tuple(sorted((float(k), float(v)) for k, v in rates.get(policy, {}).items()))

    return replace(model, hit_rate_curve=curve("lru"), hot_hit_rate_curve=curve("lru-hot"))
