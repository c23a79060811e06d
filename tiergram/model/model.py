"""The reference Engram LM in one file: RMSNorm, rotary positions, GQA attention, SwiGLU, Engram layers
(docs/model.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tiergram.engram import Engram, EngramConfig, RMSNorm, RowSourceTable
from tiergram.hashing import NgramHasher
from tiergram.model.config import ModelConfig
from tiergram.model.context import EngramInput, StepContext, current_step
from tiergram.model.moe import make_ffn
from tiergram.store.contract import RowStore


def make_hasher(config: ModelConfig, *, tokenizer=None, compression=None) -> NgramHasher:
    """The model's n-gram hasher: tokenizer compression, an explicit lookup [V], or identity (neither)."""
    e = config.engram
    if e is None:
        raise ValueError("this model config has no Engram layers, so it has no hasher")
    source = ({"tokenizer": tokenizer} if tokenizer is not None else {"compression": compression}
              if compression is not None else {"compressed_vocab_size": config.vocab_size})
    return NgramHasher(e.engram_vocab_size, e.max_ngram_size, e.n_head_per_ngram, e.layers, e.pad_id, e.seed,
                       **source)


@dataclass
class Past:
    """What a batch of sequences has processed so far, for decoding one chunk at a time."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per block: keys, values [B, n_kv_heads, P, head_dim]
    conv: dict[int, torch.Tensor]  # per Engram layer: its last (kernel-1)*dilation values [B, W, 1, d]
    tokens: torch.Tensor  # the last max_ngram_size-1 token ids [B, K]: the hashing's lookback
    length: int  # P: positions processed


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + hd/2]) of x [B, nh, T, hd] by position angles (cos, sin [T, hd/2])."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal GQA self-attention with rotary positions, a K/V cache, or the engine's paged K/V under a step context."""

    def __init__(self, config: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id  # its slice of a step context's K/V cache
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [B, T, d], cos/sin [T, hd/2], kv [B, nkv, P, hd] -> (y [B, T, d], (keys, values) [B, nkv, P+T, hd])."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        p = k.shape[2] - t
        if p == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # query i sits at position p + i and sees keys 0..p+i
            mask = torch.arange(t, device=x.device)[:, None] + p >= torch.arange(p + t, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1)), (k, v)

    def paged(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """A step's flat tokens h [N, d], cos/sin [N, hd/2] -> [N, d], over the paged K/V (written first)."""
        n, nh, nkv, hd = h.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.wq(h).view(1, n, nh, hd).transpose(1, 2), cos, sin)[0].transpose(0, 1)  # [N, nh, hd]
        k = apply_rope(self.wk(h).view(1, n, nkv, hd).transpose(1, 2), cos, sin)[0].transpose(0, 1)
        kc, vc, layout = ctx.k_cache[self.layer_id], ctx.v_cache[self.layer_id], ctx.layout
        kc[layout.slots] = k.to(kc.dtype)
        vc[layout.slots] = self.wv(h).view(n, nkv, hd).to(vc.dtype)
        out = torch.empty_like(q)
        for g in layout.groups:
            qp = q.new_zeros(len(g.members), g.t_max, nh, hd)
            qp[g.seq, g.col] = q[g.rows]
            keys, values = kc[g.key_slots].transpose(1, 2), vc[g.key_slots].transpose(1, 2)  # [Bg, nkv, P, hd]
            y = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=g.mask, enable_gqa=True)
            out[g.rows] = y.transpose(1, 2)[g.seq, g.col]
        return self.wo(out.reshape(n, nh * hd))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, d]."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def engram_step(engram: Engram, hidden: torch.Tensor, rows: torch.Tensor, conv_past: torch.Tensor | None):
    """Engram.forward carrying the conv lookback: hidden [B, T, 1, d], rows [B, T, H, D], conv_past [B, W', 1, d]
    -> (out [B, T, 1, d], new lookback [B, W, 1, d] | None)."""
    t = hidden.shape[1]
    value = engram.gated_value(hidden, rows=rows)[0]  # [B, T, hc, d]
    if engram.short_conv is None:
        return value, None
    ctx = value if conv_past is None else torch.cat([conv_past, value], dim=1)
    out = value + engram.short_conv(ctx)[:, -t:]  # causal: outputs at the new positions only need ctx
    w = (engram.config.conv_kernel - 1) * engram.config.max_ngram_size
    return out, ctx[:, max(0, ctx.shape[1] - w):]


def engram_paged(engram: Engram, x: torch.Tensor, given: EngramInput, ctx: StepContext, layer: int) -> torch.Tensor:
    """A step's flat tokens x [N, d], rows [N, H, D] -> Engram output [N, d] (conv lookback paged in ctx.e_cache)."""
    rows, keep, layout = given.rows.to(x.device), given.keep, ctx.layout
    value = engram.gated_value(x[None, :, None, :], rows=rows[None])[0][0]  # [N, 1, d]
    if keep is not None:
        value = value * keep.to(value.dtype)[:, None, None]
    if engram.short_conv is None:
        return value[:, 0]
    w = (engram.config.conv_kernel - 1) * engram.config.max_ngram_size
    cache = ctx.e_cache[layer]
    out = value.clone()
    for g in layout.groups:
        past = value.new_zeros(len(g.members), w + g.t_max, *value.shape[1:])  # [Bg, W + T, 1, d]
        # positions before the sequence's start stay zero: the conv's own left padding
        past[:, :w] = cache[g.conv_slots] * g.conv_valid[:, :, None, None].to(value.dtype)
        past[g.seq, w + g.col] = value[g.rows]
        out[g.rows] += engram.short_conv(past)[g.seq, w + g.col]
    cache[layout.slots] = value.to(cache.dtype)
    if keep is not None:
        out = out * keep.to(out.dtype)[:, None, None]
    return out[:, 0]


class Block(nn.Module):
    """One transformer block, with an Engram module in front of attention when engram is given."""

    def __init__(self, config: ModelConfig, engram: Engram | None = None, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.engram = engram
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, layer_id)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, rows: torch.Tensor | None = None,
                conv: torch.Tensor | None = None):
        """x [B, T, d], rows [B, T, H, D] (None: Engram off) -> (x, (keys, values), conv lookback | None)."""
        ctx = current_step()
        if ctx is not None:
            if self.engram is not None and self.layer_id in ctx.engram:
                given = ctx.engram[self.layer_id]()  # waits for the prefetched rows only now
                x = x + engram_paged(self.engram, x[0], given, ctx, self.layer_id)[None].to(x.dtype)
            x = x + self.attn.paged(self.attn_norm(x)[0], cos, sin, ctx)[None]
            return x + self.mlp(self.mlp_norm(x)), None, None
        if rows is not None:
            out, conv = engram_step(self.engram, x.unsqueeze(2), rows, conv)  # [B, T, hc=1, d]
            x = x + out.squeeze(2).to(x.dtype)
        h, kv = self.attn(self.attn_norm(x), cos, sin, kv)
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return x, kv, conv


class EngramLM(nn.Module):
    """Decoder-only LM. forward(ids [B, T], past) -> (logits [B, T, V], past | None)."""

    def __init__(self, config: ModelConfig, hasher: NgramHasher | None = None,
                 tables: dict[int, nn.Module] | None = None):
        """hasher None: the identity hasher; tables: {layer: module} replacing the trainable tables."""
        super().__init__()
        self.config = config
        e = config.engram
        self.hasher: NgramHasher | None = None
        self.engram_layers: list[int] = [] if e is None else sorted(e.layers)
        if e is not None:
            self.hasher = hasher if hasher is not None else make_hasher(config)
            check_hasher(self.hasher, config)
        elif hasher is not None or tables:
            raise ValueError("a model without Engram layers takes no hasher or tables")
        tables = dict(tables or {})
        if set(tables) - set(self.engram_layers):
            raise ValueError(f"tables for layers {sorted(set(tables) - set(self.engram_layers))}, but the "
                             f"Engram layers are {self.engram_layers}")

        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        blocks = []
        for i in range(config.n_layers):
            engram = None
            if i in self.engram_layers:
                ecfg = EngramConfig(d_model=config.d_model, head_sizes=self.hasher.head_sizes(i), dim=e.dim,
                                    max_ngram_size=e.max_ngram_size, hc_mult=1, conv_kernel=e.conv_kernel,
                                    norm_eps=config.norm_eps)
                engram = Engram(ecfg, tables.get(i))
            blocks.append(Block(config, engram, layer_id=i))
            blocks[-1].mlp = make_ffn(config, i, blocks[-1].mlp)  # an MoE where config.moe routes block i
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        hd = config.head_dim  # rotary tables [max_seq, hd/2]
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(config.max_seq, dtype=torch.float64), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2-style init: N(0, 0.02), residual outputs scaled by 1/sqrt(2 n_layers), zero short conv."""
        out_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight", "value_proj.weight")):
                nn.init.normal_(p, std=out_std)
            elif name.endswith("short_conv.conv.weight"):
                nn.init.zeros_(p)  # Engram starts as its gated value alone; the conv grows in training
            elif name.endswith(".bias"):  # only Engram's value/key projections have biases
                nn.init.zeros_(p)
            elif p.ndim == 2 and p is not self.tok_emb.weight:
                nn.init.normal_(p, std=0.02)
        # table rows N(0, 0.02) too: with N(0, 1) the model trained 0.4-0.5 nats worse over its first 100 steps

    def engram_row_ids(self, ids: torch.Tensor, history: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Token ids [B, T] (after history [B, K], if any) -> {layer: row ids int64 [B, T, H]} on ids' device."""
        if self.hasher is None:
            return {}
        rows = self.hasher.row_ids_with_history(ids, history)
        return {layer: torch.from_numpy(r).to(ids.device) for layer, r in rows.items()}

    def engram_tables(self) -> dict[int, nn.Module]:
        """{layer: the table module its Engram reads rows from}."""
        return {i: self.blocks[i].engram.table for i in self.engram_layers}

    def active_engram_layers(self, engram_enabled: bool | Iterable[int] = True) -> list[int]:
        """The Engram layers left on by engram_enabled (True: all, False: none, or the layer ids to keep)."""
        if engram_enabled is True:
            return list(self.engram_layers)
        if engram_enabled is False:
            return []
        layers = sorted(set(int(i) for i in engram_enabled))
        if set(layers) - set(self.engram_layers):
            raise ValueError(f"engram_enabled names layers {layers}, but the Engram layers are "
                             f"{self.engram_layers}")
        return layers

    def _row_fetchers(self, ids: torch.Tensor, past: Past | None, active: list[int],
                      engram_rows: dict[int, torch.Tensor] | None) -> dict[int, Callable[[], torch.Tensor]]:
        """Hash once and start every active layer's fetch; each fetcher returns rows [B, T, H, D] when called."""
        fetchers: dict[int, Callable[[], torch.Tensor]] = {}
        given = dict(engram_rows or {})
        need = [layer for layer in active if layer not in given]
        row_ids = self.engram_row_ids(ids, past.tokens if past is not None else None) if need else {}
        for layer in active:
            if layer in given:
                fetchers[layer] = lambda r=given[layer]: r
                continue
            table = self.blocks[layer].engram.table
            source = table.source if isinstance(table, RowSourceTable) else None
            if isinstance(source, RowStore):  # a store: prefetch now, wait when the layer runs
                ticket = source.prefetch(row_ids[layer])  # reads while the blocks before this one run
                fetchers[layer] = lambda tk=ticket, tb=table: tb.adopt(tk.wait())
            else:
                fetchers[layer] = lambda tb=table, r=row_ids[layer]: tb(r)
        return fetchers

    def forward(self, ids: torch.Tensor, past: Past | None = None, *, use_cache: bool = False,
                engram_rows: dict[int, torch.Tensor] | None = None,
                engram_enabled: bool | Iterable[int] = True) -> tuple[torch.Tensor, Past | None]:
        """ids int64 [B, T] after `past` -> (logits float [B, T, V], past' when use_cache or past); docs/model.md."""
        ctx = current_step()
        if ctx is not None:
            return self.forward_step(ids, ctx), None
        if ids.ndim != 2:
            raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
        b, t = ids.shape
        start = past.length if past is not None else 0
        if start + t > self.config.max_seq:
            raise ValueError(f"sequence of {start + t} positions exceeds max_seq {self.config.max_seq}")
        if past is not None and past.tokens.shape[0] != b:
            raise ValueError(f"past holds {past.tokens.shape[0]} sequences but ids has {b}")
        use_cache = use_cache or past is not None
        active = self.active_engram_layers(engram_enabled)
        for layer, rows in (engram_rows or {}).items():
            if layer not in active:
                raise ValueError(f"engram_rows given for layer {layer}, which is not an active Engram layer "
                                 f"({active})")
            if tuple(rows.shape[:2]) != (b, t):
                raise ValueError(f"engram_rows[{layer}] has shape {tuple(rows.shape)}, expected [{b}, {t}, H, D]")
        fetchers = self._row_fetchers(ids, past, active, engram_rows)

        cos, sin = self.rope_cos[start:start + t], self.rope_sin[start:start + t]
        x = self.tok_emb(ids)
        kvs, convs = [], {}
        for i, block in enumerate(self.blocks):
            rows = fetchers[i]() if i in fetchers else None
            x, kv, conv = block(x, cos, sin, kv=past.kv[i] if past is not None else None, rows=rows,
                                conv=past.conv.get(i) if past is not None else None)
            if use_cache:
                kvs.append(kv)
                if conv is not None:  # a layer switched off for this chunk returns its lookback unchanged
                    convs[i] = conv
        x = self.norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.tok_emb.weight)
        if not use_cache:
            return logits.float(), None
        k = self.config.engram.max_ngram_size - 1 if self.config.engram is not None else 0
        prev = past.tokens if past is not None else ids[:, :0]
        tokens = torch.cat([prev, ids], dim=1)[:, max(0, prev.shape[1] + t - k):]
        return logits.float(), Past(kv=kvs, conv=convs, tokens=tokens, length=start + t)

    def forward_step(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """One engine step: flat tokens ids [1, N] -> logits float [1, B, V] at the sequences' last tokens."""
        layout = ctx.layout
        cos, sin = self.rope_cos[layout.positions], self.rope_sin[layout.positions]  # [N, hd/2]
        x = self.tok_emb(ids)  # [1, N, d]
        for block in self.blocks:
            x, _, _ = block(x, cos, sin)
        h = self.norm(x[0, layout.last])  # [B, d]
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.tok_emb.weight)
        return logits.float()[None]

    def table_parameters(self) -> list[nn.Parameter]:
        """The trainable Engram table weights (sparse gradients)."""
        return [p for n, p in self.named_parameters() if ".engram.table." in n]

    def num_params(self) -> dict[str, int]:
        """{'backbone': parameters outside the Engram tables, 'tables': table values}."""
        tables = sum(p.numel() for p in self.table_parameters())
        return {"backbone": sum(p.numel() for p in self.parameters()) - tables, "tables": tables}


def check_hasher(hasher: NgramHasher, config: ModelConfig) -> None:
    """Raise if the hasher's geometry does not match the config's Engram settings."""
    e = config.engram
    want = {"layer_ids": sorted(e.layers), "max_ngram_size": e.max_ngram_size,
            "n_head_per_ngram": e.n_head_per_ngram, "engram_vocab_size": list(e.engram_vocab_size),
            "vocab_size": config.vocab_size, "pad_id": e.pad_id, "seed": e.seed}
    have = {**hasher.config(), "layer_ids": sorted(hasher.layer_ids)}
    bad = [f"{k} {have[k]} != {want[k]}" for k in want if have[k] != want[k]]
    if bad:
        raise ValueError(f"hasher does not match the model config: {'; '.join(bad)}")
