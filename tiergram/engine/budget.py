"""Device memory arithmetic, as in vLLM: KV cache = budget - weights - device-placed tables - activations."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from tiergram.model.config import ModelConfig
from tiergram.tiers.device import DEVICE_BYTES_ENV, device_memory_budget

DEFAULT_CPU_BYTES = 2 << 30  # the CPU stands in for a device with this much memory unless told otherwise


def budget_bytes(device: torch.device, configured: int | None) -> int:
    """The device budget: configured, else CUDA's free memory now, else $TIERGRAM_DEVICE_BYTES or 2 GiB on the CPU."""
    if configured is not None:
        return int(configured)
    if device.type == "cuda" or os.environ.get(DEVICE_BYTES_ENV):
        return device_memory_budget(device)
    return DEFAULT_CPU_BYTES


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: keys, values and the Engram short conv's input of block_size tokens, every layer."""
    elem = torch.empty(0, dtype=dtype).element_size()
    e = config.engram
    conv_layers = len(e.layers) if e is not None and e.conv_kernel > 0 else 0
    per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim + conv_layers * config.d_model
    return per_token * block_size * elem


def activation_bytes(config: ModelConfig, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                     dtype: torch.dtype) -> int:
    """An upper estimate of one step's live activations: token-wise tensors, padded attention, last-token logits."""
    elem = torch.empty(0, dtype=dtype).element_size()
    e = config.engram
    engram_width = e.n_heads * e.dim if e is not None else 0
    per_token = 6 * config.d_model + 3 * config.ffn + 3 * config.n_heads * config.head_dim + 2 * engram_width
    attention = (2 * max_num_seqs * max_model_len * config.n_kv_heads * config.head_dim  # gathered K/V
                 + config.n_heads * max_num_batched_tokens * max_model_len)  # scores of the prefill group
    return elem * (max_num_batched_tokens * per_token + attention + max_num_seqs * config.vocab_size)


@dataclass
class Budget:
    """Where the device budget goes; kv_blocks is what the KV pool gets."""

    total_bytes: int  # the device budget
    weights_bytes: int  # model parameters and buffers on the device (Engram tables excluded)
    device_table_bytes: int  # encoded bytes of device-placed tables (the table files' data regions)
    activation_bytes: int  # reserve for one step's activations (estimate)
    block_bytes: int  # one KV block
    block_size: int
    kv_blocks_affordable: int  # what the bytes left over buy
    kv_blocks: int  # allocated: affordable, capped at what max_num_seqs full-length sequences can use
    blocks_per_seq: int  # blocks a max_model_len sequence needs

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.block_bytes

    @property
    def max_concurrency(self) -> int:
        """Full-length sequences the affordable KV blocks hold at once."""
        return self.kv_blocks_affordable // self.blocks_per_seq

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "kv_bytes": self.kv_bytes, "max_concurrency": self.max_concurrency}


def plan_budget(total_bytes: int, *, weights_bytes: int, device_table_bytes: int, activation_bytes: int,
                block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
                num_kv_blocks: int | None = None) -> Budget:
    """Split the budget; ValueError when what is left cannot hold one full-length sequence."""
    blocks_per_seq = -(-max_model_len // block_size)
    left = total_bytes - weights_bytes - device_table_bytes - activation_bytes
    affordable = max(0, left) // block_bytes
    blocks = min(affordable, max_num_seqs * blocks_per_seq) if num_kv_blocks is None else num_kv_blocks
    if blocks < blocks_per_seq:
        why = (f"num_kv_blocks {num_kv_blocks}" if num_kv_blocks is not None else
               f"the device budget of {total_bytes:,} B leaves {max(0, left):,} B after weights {weights_bytes:,} B, "
               f"device tables {device_table_bytes:,} B and activations {activation_bytes:,} B, i.e. {affordable}"
               f" blocks of {block_bytes:,} B")
        raise ValueError(f"{why}: one sequence of max_model_len {max_model_len} needs {blocks_per_seq} KV blocks; "
                         "raise device_memory_bytes, place tables off the device, or lower max_model_len")
    return Budget(total_bytes, weights_bytes, device_table_bytes, activation_bytes, block_bytes, block_size,
                  affordable, blocks, blocks_per_seq)
