"""docs/troubleshooting.md's common errors are raykv's own messages: each fragment the
table quotes is in the product's code, so a reworded message cannot leave a stale entry
(a control shows a fragment no module holds is caught)."""

from __future__ import annotations

import re

from tests.unit.test_docs_once import ROOT, modules

DOC = (ROOT / "docs" / "troubleshooting.md").read_text()


def fragments(doc: str) -> list[str]:
    """The first cell of each row of the *Common errors* table, unquoted."""
    table = doc.split("\n## Common errors\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for line in table.splitlines()
            if (m := re.match(r"\| `([^`]+)` \|", line))]


def unknown(found: list[str], code: str) -> list[str]:
    """The fragments of ``found`` that ``code`` does not hold."""
    return [f for f in found if f not in code]


def test_every_common_error_quoted_is_a_message_of_the_code():
    # every module's text, whitespace as one space and adjacent string literals joined
    code = re.sub(r'"\s+[frb]{0,2}"', "", "\n".join(
        " ".join((ROOT / f).read_text().split()) for f in modules()))
    found = fragments(DOC)
    assert len(found) >= 8
    assert unknown(found, code) == []
    # CONTROL: a message no module raises is caught
    assert unknown(["the node actor is on fire"], code) == ["the node actor is on fire"]
