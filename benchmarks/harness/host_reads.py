"""Counts what would make the host wait for a GPU's tensor data, on any device.

On a GPU these stall the host until the device has caught up: reading a value
(``aten._local_scalar_dense``: ``item()``, ``int(t)``, ``bool(t)``), operations whose output
shape depends on the values (``nonzero``, indexing by a mask, ``masked_select``,
``repeat_interleave`` without ``output_size``, ``bincount``, ``unique``), and copies to the
host. The operations are seen by a torch dispatch mode; copies to the host do not reach the
dispatcher on CPU tensors, so ``Tensor.tolist``, ``Tensor.cpu`` and ``Tensor.numpy`` are
wrapped while counting. (``Tensor.to(device)`` cannot be told apart from a move between
devices when every tensor is on the CPU; the packages copy to the host with ``.cpu()`` or
``.tolist()``.) What ``.cpu()`` returns is a host tensor, and so is whatever is computed from
host tensors alone: reading those costs no wait, and is not counted.

Each read is recorded with its site: the innermost frame in the project's packages (else the
innermost outside torch), or ``autograd`` for a read inside a built-in backward formula.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HostRead", "HostReadCounter"]

VALUE_READS = {"_local_scalar_dense": "item"}
SHAPE_FROM_VALUES = {
    "nonzero",
    "masked_select",
    "bincount",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "argwhere",
}
"""Operations whose output's size depends on their input's values."""

HOST_COPIES = ("tolist", "cpu", "numpy")
"""Tensor methods that copy to the host (wrapped while counting)."""

_THIS_FILE = str(Path(__file__).resolve())
_TORCH_FOLDER = str(Path(torch.__file__).resolve().parent)


@dataclass(frozen=True)
class HostRead:
    what: str
    """The operation or method: item, nonzero, index (by a mask), tolist, ..."""
    site: str
    """``package/module.py:function``, where the project's code asked for it."""


def _site() -> str:
    frame = sys._getframe(1)
    outside_torch = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _THIS_FILE and not path.startswith(_TORCH_FOLDER):
            parts = Path(path).parts
            if "packages" in parts and "src" in parts:
                return f"{'/'.join(parts[parts.index('src') + 1 :])}:{frame.f_code.co_name}"
            outside_torch = outside_torch or f"{Path(path).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return outside_torch or "autograd"


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _reads_host(name: str, args: tuple, kwargs: dict) -> str | None:
    """What the operation reads on the host, or None."""
    if name in VALUE_READS:
        return VALUE_READS[name]
    if name in SHAPE_FROM_VALUES:
        return name
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        is_counts_only = len(args) == 1 or isinstance(args[1], torch.Tensor)
        return name if is_counts_only else None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(_is_mask(i) for i in indices):
            return f"{name} (by a mask)"
    return None


@dataclass
class HostReadCounter(TorchDispatchMode):
    """While entered, records every host read (``reads``); ``by_site()`` counts them."""

    reads: list[HostRead] = field(default_factory=list)
    _host: dict[int, torch.Tensor] = field(default_factory=dict)
    """Storages of host tensors, by address (kept alive so that no address is reused)."""

    def __post_init__(self) -> None:
        super().__init__()

    def _is_host(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._host

    def _mark_host(self, tensor: torch.Tensor) -> None:
        self._host[tensor.untyped_storage().data_ptr()] = tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # A zero-dim tensor (a Python number the call wrapped, say) goes where the others go:
        # torch mixes only host scalars into device operations.
        placed = [t for t in tensors if t.dim() > 0] or tensors
        on_host = bool(placed) and all(self._is_host(t) for t in placed)
        what = _reads_host(func.overloadpacket.__name__, args, kwargs)
        if what is not None and tensors and not on_host:
            self.reads.append(HostRead(what, _site()))
        out = func(*args, **kwargs)
        if on_host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark_host(t)
        return out

    def __enter__(self) -> HostReadCounter:
        self._copies = contextlib.ExitStack()
        self._copies.enter_context(self._wrapped_copies())
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._copies.close()

    @contextlib.contextmanager
    def _wrapped_copies(self) -> Iterator[None]:
        originals = {name: getattr(torch.Tensor, name) for name in HOST_COPIES}

        def wrap(name: str):
            original = originals[name]

            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if self._is_host(tensor):
                    return original(tensor, *args, **kwargs)
                self.reads.append(HostRead(name, _site()))
                if name != "cpu":
                    return original(tensor, *args, **kwargs)
                host = original(tensor, *args, **kwargs).clone()  # a copy, as from a device
                self._mark_host(host)
                return host

            return counted

        try:
            for name in HOST_COPIES:
                setattr(torch.Tensor, name, wrap(name))
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    def by_site(self) -> Counter[str]:
        """How many reads each ``site (what)`` made."""
        return Counter(f"{read.site} ({read.what})" for read in self.reads)
