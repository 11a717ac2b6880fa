"""Module selection shared by every callback: ``include``, ``exclude``, ``types``, ``max_depth``."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "ModuleSelector",
    "is_compile_wrapper",
    "is_layer",
    "label",
    "named_parameters",
    "output_label",
    "trainable_parameters",
    "type_label",
]

_COMPILE_WRAPPER = "_orig_mod"
_WRAPPERS = (_COMPILE_WRAPPER, "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""The attribute under which each wrapper (torch.compile, FSDP1, activation checkpointing) keeps the module it wraps."""


def unwrapped(name: str) -> str:
    """A qualified name with the wrappers' attributes left out: ``enc._orig_mod.fc.weight`` is ``enc.fc.weight``."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under the names :func:`named_modules` gives their modules."""
    return ((unwrapped(name), param) for name, param in model.named_parameters())


def label(name: str) -> str:
    """The name a module is shown under in tables and tags: its qualified name, or ``root`` for the model itself."""
    return name or "root"


def output_label(module: str, path: str) -> str:
    """``<layer>`` for a module's only output tensor, ``<layer>.out.<path>`` inside a nested output."""
    return label(module) if not path else f"{label(module)}.out.{path}"


def type_label(module: nn.Module) -> str:
    """The class name a module is shown under: FSDP2's ``fully_shard`` swaps ``Linear`` for a
    subclass ``FSDPLinear``, shown as ``Linear``."""
    cls = next((c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed.fsdp")), nn.Module)
    return cls.__name__


def _known_module_types() -> set[str]:
    seen: set[str] = set()
    stack: list[type] = [nn.Module]
    while stack:
        cls = stack.pop()
        if cls.__name__ not in seen:
            seen.add(cls.__name__)
            stack.extend(cls.__subclasses__())
    return seen


def _str_list(owner: str, arg: str, value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(
            f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a list of strings or None"
            + (f", e.g. `{arg}=[{value!r}]`." if isinstance(value, str) else ".")
        )
    return list(value)


def _few(names: Sequence[str], near: str = "", n: int = 8) -> str:
    """Up to ``n`` of ``names``, those close to ``near`` first, each group in the order given."""
    close = set(difflib.get_close_matches(near, names, n=n, cutoff=0.4)) if near else set()
    shown = ([x for x in names if x in close] + [x for x in names if x not in close])[:n]
    more = f", ... ({len(names) - len(shown)} more)" if len(names) > len(shown) else ""
    return ", ".join(repr(x) for x in shown) + more


@dataclass(frozen=True)
class ModuleSelector:
    """Which modules of a model a callback hooks.

    A module is selected when its qualified name matches one of ``include`` (all names when
    ``None``), matches none of ``exclude``, its class or one of its base classes is named in
    ``types`` (any class when ``None``), and it is at most ``max_depth`` levels below the model
    (the model is depth 0, its children depth 1).

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [name for name, _ in ModuleSelector(types=["Linear"]).select(model)]
        ['0', '2']
        >>> [name for name, _ in ModuleSelector(exclude=["1"], max_depth=1).select(model)]
        ['', '0', '2']
    """

    include: list[str] | None = None
    exclude: list[str] | None = None
    types: list[str] | None = None
    max_depth: int | None = None
    owner: str = "ModuleSelector"

    def __post_init__(self) -> None:
        for arg in ("include", "exclude", "types"):
            object.__setattr__(self, arg, _str_list(self.owner, arg, getattr(self, arg)))
        if self.types is not None:
            known = _known_module_types()
            unknown = [t for t in self.types if t not in known]
            if unknown:
                raise ValueError(
                    f"`{self.owner}` got `types={self.types!r}`; {unknown[0]!r} is not the name of any "
                    f"`torch.nn.Module` subclass imported so far. Known names include: "
                    f"{_few(sorted(known), unknown[0])}."
                )
        if self.max_depth is not None and (
            isinstance(self.max_depth, bool) or not isinstance(self.max_depth, int) or self.max_depth < 0
        ):
            raise ValueError(
                f"`{self.owner}` got `max_depth={self.max_depth!r}`; `max_depth` must be an integer >= 0 or None."
            )

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The selected ``(qualified name, module)`` pairs in registration order.

        Raises:
            ValueError: if a pattern in ``include`` or a name in ``types`` matches no module of
                ``model``; the message lists some names that would.
        """
        candidates = list(named_modules(model))
        names = [name for name, _ in candidates]
        for pattern in self.include or []:
            if not any(fnmatchcase(name, pattern) for name in names):
                raise ValueError(
                    f"`{self.owner}` got `include={self.include!r}`; {pattern!r} matches no module of "
                    f"{type(model).__name__}. Qualified module names look like: {_few(names, pattern)} "
                    f"('' is the model itself; patterns use fnmatch syntax, e.g. 'encoder.*')."
                )
        if self.types is not None:
            # the model's own classes in model order, then the classes they derive from
            own = list(dict.fromkeys(type(m).__name__ for _, m in candidates))
            present = own + sorted({c.__name__ for _, m in candidates for c in type(m).__mro__} - set(own))
            missing = [t for t in self.types if t not in present]
            if missing:
                raise ValueError(
                    f"`{self.owner}` got `types={self.types!r}`, but {type(model).__name__} has no module of "
                    f"type {missing[0]!r}. Types in this model include: {_few(present, missing[0])}."
                )
        return [(name, module) for name, module in candidates if self._wanted(name, module)]

    def _wanted(self, name: str, module: nn.Module) -> bool:
        return (
            (self.include is None or any(fnmatchcase(name, p) for p in self.include))
            and (self.exclude is None or not any(fnmatchcase(name, p) for p in self.exclude))
            and (self.types is None or any(cls.__name__ in self.types for cls in type(module).__mro__))
            and (self.max_depth is None or depth(name) <= self.max_depth)
        )


def depth(name: str) -> int:
    """How many levels below the model a qualified name is (the model itself is 0)."""
    return name.count(".") + 1 if name else 0


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` under qualified names, with each wrapper (``torch.compile``, FSDP1, activation
    checkpointing) replaced by the module it wraps, under the wrapper's name, and ``torchmetrics`` metrics left
    out: they are modules for device placement only, not part of the model."""
    metrics: list[str] = []
    for name, module in model.named_modules():
        if any(name == m or name.startswith(m + ".") for m in metrics):
            continue
        if any(cls.__module__.split(".")[0] == "torchmetrics" for cls in type(module).__mro__):
            metrics.append(name)
        elif not any(isinstance(getattr(module, attr, None), nn.Module) for attr in _WRAPPERS):
            yield unwrapped(name), module


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` puts around a module (``OptimizedModule``)."""
    return isinstance(getattr(module, _COMPILE_WRAPPER, None), nn.Module)


def is_layer(name: str, module: nn.Module) -> bool:
    """Whether ``module`` computes one layer of the forward: it has no submodules, or only the parametrizations of its
    weights (``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm``), or it is an
    ``nn.MultiheadAttention``, which hands its ``out_proj``'s weights to the attention function instead of calling it.
    A parametrization's own modules compute weights, not outputs of the model.

    Example::

        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> model = nn.Sequential(weight_norm(nn.Linear(2, 3)), nn.ReLU())
        >>> [name for name, m in model.named_modules() if is_layer(name, m)]
        ['0', '1']
        >>> is_layer("attention", nn.MultiheadAttention(3, 1))
        True
    """
    if "parametrizations" in name.split("."):
        return False
    owned = {id(module.parametrizations)} if parametrize.is_parametrized(module) else set()
    return isinstance(module, nn.MultiheadAttention) or all(id(m) in owned for m in module.children())


def trainable_parameters(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Parameter]]:
    """``(qualified name, parameter)`` for the parameters owned by ``modules`` that require grad,
    each shared parameter once, under its first name."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for name, module in modules:
        for pname, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                found.setdefault(id(param), (f"{name}.{pname}" if name else pname, param))
    return list(found.values())
