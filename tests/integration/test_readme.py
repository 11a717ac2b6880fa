"""The README's interactive examples run and print what the README says."""

import doctest
import re
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def test_readme_examples() -> None:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if b.lstrip().startswith(">>>")]
    assert blocks, "the README has no interactive example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for i, block in enumerate(blocks):
        runner.run(doctest.DocTestParser().get_doctest(block, {}, f"README block {i}", str(README), 0))
    results = runner.summarize(verbose=False)
    assert results.failed == 0
