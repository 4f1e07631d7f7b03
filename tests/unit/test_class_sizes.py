"""No product class over 300 lines (the developer guide's limit): every class in the
package's folders, counted from its ``class`` line to its last line, decorators aside."""

import ast

from tests.unit.test_docs_once import ROOT, modules

LIMIT = 300


def oversized(source: str, name: str) -> list[str]:
    """``"file:Class (N lines)"`` for each class in ``source`` longer than ``LIMIT``."""
    return [f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > LIMIT]


def test_no_product_class_exceeds_300_lines():
    files = modules()
    assert len(files) > 100
    assert [o for f in files for o in oversized((ROOT / f).read_text(), f)] == []
    # CONTROL: a class one line over the limit is caught, one at the limit is not
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT - 1))
    assert oversized(f"class Big:\n{body}\n    y = 0\n", "big.py") == ["big.py:Big (301 lines)"]
    assert oversized(f"class Fits:\n{body}\n", "fits.py") == []
