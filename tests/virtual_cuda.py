"""A virtual CUDA device for CPU-only tests: which tensors a CUDA run would hold on the GPU, and where it would mix.

Run code under `VirtualCuda()` with its device being the CPU: a tensor counts as on the GPU when a factory or `.to`
was given an explicit device (or another such tensor), or when an op computed it from one; `.cpu()`, `from_numpy`
and factories without a device give host tensors. `flags` counts what raises on a real GPU: an op mixing GPU and
host tensors (0-dim host tensors are allowed, as CUDA allows them), a host tensor indexed with GPU indices, a GPU
tensor assigned host values through indexing, `.numpy()` of a GPU tensor, multinomial with a host generator on GPU
probabilities. Torch function modes are per thread: work in other threads (prefetch workers) is not seen.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "randint", "rand", "randn",
             "randperm", "linspace", "eye", "from_numpy", "zeros_like", "empty_like", "ones_like", "full_like",
             "new_zeros", "new_empty", "new_full", "new_ones", "new_tensor"}
INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
INPLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "matmul",
                                           "and", "or", "xor", "lshift", "rshift")}


class VirtualCuda(TorchFunctionMode):
    def __init__(self, watch: str = "tiergram") -> None:
        super().__init__()
        self.watch = watch  # flags name the innermost frame whose file path contains this
        self.on_gpu = WeakIdKeyDictionary()
        self.flags: collections.Counter = collections.Counter()  # (what, op, file:line) -> times

    def mark(self, *tensors: torch.Tensor) -> None:
        """Count these tensors as on the GPU."""
        for t in tensors:
            self.on_gpu[t] = True

    def gpu(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.on_gpu

    def _flag(self, what: str, func) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if self.watch in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.flags[(what, getattr(func, "__name__", str(func)), where)] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        gpu_in = [t for t in tensors if self.gpu(t)]
        host_in = [t for t in tensors if not self.gpu(t) and t.dim() > 0]
        if name in ("numpy", "__array__") and self.gpu(args[0]):
            self._flag("numpy of a GPU tensor", func)
        elif name == "multinomial" and gpu_in and getattr(kwargs.get("generator"), "device", None) == \
                torch.device("cpu"):
            self._flag("host generator, GPU probabilities", func)
        elif func in INDEXING:
            index = [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
            if not self.gpu(args[0]) and any(self.gpu(t) for t in index):
                self._flag("host tensor, GPU index", func)
            value = args[2] if len(args) > 2 else None
            if isinstance(value, torch.Tensor) and value.dim() > 0 and self.gpu(value) != self.gpu(args[0]):
                self._flag("assigned a tensor of the other device", func)
        elif name == "__set__" and len(tensors) == 2:  # `t.data = other` (Module.to): t moves to other's device
            out = func(*args, **kwargs)
            if self.gpu(tensors[1]):
                self.mark(tensors[0])
            else:
                self.on_gpu.pop(tensors[0], None)
            return out
        elif gpu_in and host_in and name not in ("to", "cpu", "copy_", "_has_compatible_shallow_copy_type",
                                                 "__repr__", "__format__"):
            self._flag("GPU and host tensors in one op", func)
        out = func(*args, **kwargs)
        if name == "to":
            moved = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str, torch.Tensor))]
            on = self.gpu(args[0]) if not moved else (self.gpu(moved[0]) if isinstance(moved[0], torch.Tensor)
                                                       else True)
        elif name == "cpu":
            on = False
        elif name in FACTORIES:
            on = kwargs.get("device") is not None or (name.endswith("_like") or name.startswith("new_")) \
                and self.gpu(args[0])
        elif name == "__setitem__" or name in INPLACE_DUNDERS or name.endswith("_") and not name.endswith("__"):
            return out  # in place: the tensor stays where it is
        elif name == "__getitem__":
            on = self.gpu(args[0])
        else:
            on = bool(gpu_in)
        if name in ("to", "cpu") and out is args[0] and on != self.gpu(out):
            out = out.view_as(out)  # a real move makes a new tensor: the original stays where it was
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if on:
                    self.on_gpu[t] = True
                elif t in self.on_gpu:
                    del self.on_gpu[t]
        return out
