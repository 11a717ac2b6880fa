"""The documentation site, through the door a maintainer uses: `mkdocs build --strict` as `make docs` runs it, and
the built pages read back. Also: the troubleshooting page quotes every warning and error the library can give."""

from __future__ import annotations

import ast
import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_hooks
from lightning_hooks.diagnose.health import CHECKS

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "lightning_hooks"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
BUILDERS = ("mkdocs", "material", "mkdocstrings_handlers.python")
MISSING = [name for name in BUILDERS if importlib.util.find_spec(name.split(".")[0]) is None]
needs_mkdocs = pytest.mark.skipif(
    bool(MISSING), reason=f"the docs builders are not installed ({', '.join(MISSING)}): pip install -e '.[docs]'"
)

# Messages the library builds away from the `raise` or warning that gives them, by the argument's source text, and
# where the page covers them. A new one fails `test_troubleshooting_quotes_every_message` until it is added here.
INDIRECT = {
    "warning(finding)": "HealthMonitor's findings: one section per check (test_every_health_check_has_a_section)",
    "report": "NonFiniteError's report: the lines of `Finding.lines`, quoted as messages below",
}


def _callbacks() -> list[str]:
    from lightning.pytorch import Callback

    public = {name: getattr(lightning_hooks, name) for name in lightning_hooks.__all__}
    return [name for name, value in public.items() if isinstance(value, type) and issubclass(value, Callback)]


def _page_slug(name: str) -> str:
    """``GradStats`` → ``grad-stats``, ``NonFiniteGuard`` → ``nonfinite-guard``: the file name of a callback's page."""
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name.replace("NonFinite", "Nonfinite")).lower()


def _text(page: Path) -> str:
    """The visible text of a built page's article, tags dropped and whitespace collapsed."""
    source = page.read_text()
    article = source[source.find("<article") : source.find("</article>")]
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", article)))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"`mkdocs build --strict` failed:\n{done.stdout}\n{done.stderr}"
    return out


@needs_mkdocs
def test_every_callback_has_a_page_with_its_arguments_from_the_docstring(site: Path) -> None:
    for name in _callbacks():
        page = site / _page_slug(name) / "index.html"
        assert page.exists(), f"no page for {name} (docs/{_page_slug(name)}.md)"
        text = _text(page)
        assert text.startswith(f" {name} ") or f"{name} ¶" in text[:200], f"{page} is not {name}'s page"
        # The argument table comes from the class docstring's `Args:` through mkdocstrings.
        table = text[text.find("Parameters:") :]
        assert table, f"{name}'s page has no argument table"
        params = [p for p in inspect.signature(getattr(lightning_hooks, name)).parameters if p != "self"]
        missing = [p for p in params if f" {p} " not in table]
        assert not missing, f"{name}'s page does not document {missing}"
        for heading in ("Example", "Tags", "Cost"):
            assert f"{heading} ¶" in text or f"{heading}s ¶" in text, f"{name}'s page has no {heading} section"


@needs_mkdocs
def test_the_api_reference_renders_every_public_name(site: Path) -> None:
    source = (site / "api" / "index.html").read_text()
    names = [n for n in lightning_hooks.__all__ if n != "__version__"]
    missing = [n for n in names if f'id="lightning_hooks.{n}"' not in source]
    assert not missing, f"the API reference lacks {missing}"
    text = _text(site / "api" / "index.html")
    # A documented argument's own words, read from the docstring, not just its name.
    assert "Logging period in optimizer steps; None uses the Trainer's." in text
    assert "Examples: >>> from lightning.pytorch import Trainer" in text, "`Example::` blocks are not rendered"


@needs_mkdocs
def test_the_site_asks_nothing_of_the_network(site: Path) -> None:
    for page in site.rglob("*.html"):
        source = page.read_text()
        assert "fonts.googleapis.com" not in source, page
        assert "fonts.gstatic.com" not in source, page
        # every stylesheet and script the theme loads is a file of the site itself
        for url in re.findall(r'<(?:link|script)[^>]+(?:href|src)="([^"]+)"', source):
            assert not re.match(r"(https?:)?//", url), f"{page.relative_to(site)} loads {url}"


def _literal_runs(node: ast.expr) -> list[str] | None:
    """The literal pieces of a message template (a string, an f-string, a sum of them); ``None`` if not one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_runs(node.left), _literal_runs(node.right)
        return None if left is None and right is None else [*(left or []), *(right or [])]
    return None


def _plain(text: str) -> str:
    """Text as a reader sees it whether quoted in code or not: no backticks, backslashes or line breaks."""
    return re.sub(r"\s+", " ", text.replace("`", "").replace("\\", ""))


def _gives_a_message(path: Path, function: str) -> bool:
    """A warning, or a line of a `NonFiniteGuard` report (`Finding.lines` in diagnose/finding.py)."""
    return function.split(".")[-1] in ("rank_zero_warn", "warn") or (
        path.name == "finding.py" and function == "lines.append"
    )


def _messages() -> list[tuple[str, str | None, str]]:
    """Every message given by `raise Error(...)`, `rank_zero_warn(...)` and `warnings.warn(...)` in the package, and
    the lines of a `NonFiniteGuard` report: (where, its longest literal piece or None, the argument's source)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                call = node.exc
            elif isinstance(node, ast.Call) and _gives_a_message(path, ast.unparse(node.func)):
                call = node
            else:
                continue
            if not call.args:
                continue
            runs = _literal_runs(call.args[0])
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if runs is None:
                if call is node and ast.unparse(call.func) == "lines.append":
                    continue  # a line assembled elsewhere, e.g. ", ".join(where)
                found.append((where, None, ast.unparse(call.args[0])))
                continue
            pieces = [_plain(r).strip(" .,;:()'\"") for r in runs]
            found.append((where, max(pieces, key=len), ast.unparse(call.args[0])))
    return found


def test_troubleshooting_quotes_every_message() -> None:
    page = _plain(TROUBLESHOOTING.read_text())
    messages = _messages()
    assert len(messages) > 30, "the scan of the package found too few messages: is it still looking?"
    undocumented = [
        f"{where}: {piece!r}"
        for where, piece, _ in messages
        if piece is not None and len(piece) >= 4 and piece not in page
    ]
    assert not undocumented, (
        "docs/troubleshooting.md does not quote these messages (their longest literal piece is missing); add each, "
        "with what it means and what to do:\n" + "\n".join(undocumented)
    )
    indirect = sorted({source for _, piece, source in messages if piece is None} - set(INDIRECT))
    assert not indirect, f"messages built elsewhere, not covered: {indirect}; document them and add them to INDIRECT"


def test_every_health_check_has_a_section() -> None:
    headings = set(re.findall(r"^### (\w+)$", TROUBLESHOOTING.read_text(), re.M))
    assert set(CHECKS) <= headings, f"HealthMonitor checks without a troubleshooting section: {set(CHECKS) - headings}"
