"""No file of the package writes into torch's private hook dictionaries: hooks go through the public calls."""

import ast
from pathlib import Path

import torch.nn.modules.module
from torch import nn

import lightning_hooks

PACKAGE = Path(lightning_hooks.__file__).parent

PRIVATE = {
    *(name for name in vars(nn.Module()) if "hook" in name),
    *(name for name in vars(torch.nn.modules.module) if name.startswith("_global") and "hook" in name),
    "_backward_hooks",  # a tensor's
    "_post_accumulate_grad_hooks",
}
"""torch's own names for its hook dictionaries, as this torch spells them."""

MUTATORS = ("update", "clear", "pop", "popitem", "setdefault", "move_to_end", "__setitem__", "__delitem__")


def _private(node: ast.expr) -> str | None:
    """The private hook dictionary ``node`` is, or indexes into (``m._forward_hooks``, ``m._forward_hooks[k]``)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name if name in PRIVATE else None


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` for each assignment, deletion or mutating call on a private hook dictionary, and each
    string naming one (``getattr(module, "_forward_hooks")``, whose result cannot be followed)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in PRIVATE:
            found.append((node.lineno, node.value))
            continue
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        else:
            continue
        found += [(node.lineno, name) for target in targets if (name := _private(target)) is not None]
    return sorted(found)


def test_the_scan_sees_each_kind_of_write() -> None:
    source = """
m._forward_hooks[h.id] = hook
m._forward_pre_hooks_with_kwargs[h.id] = True
del m._backward_hooks[key]
m._forward_hooks_always_called.update(flags)
m._state_dict_hooks.clear()
m._forward_hooks = {}
_global_forward_hooks[1] = hook
flags = getattr(m, "_forward_hooks_with_kwargs")
self._hooks[name] = hook  # a recorder's own dict: fine
hooks = m._forward_hooks  # a read: fine
n = len(m._forward_hooks)
"""
    assert [name for _, name in _writes(ast.parse(source))] == [
        "_forward_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_forward_hooks_always_called",
        "_state_dict_hooks",
        "_forward_hooks",
        "_global_forward_hooks",
        "_forward_hooks_with_kwargs",
    ]


def test_no_file_writes_into_torchs_private_hook_dicts() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} reaches into `{name}`"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name in _writes(ast.parse(path.read_text(), str(path)))
    ]
    assert found == [], "register hooks with torch's public calls instead:\n" + "\n".join(found)
