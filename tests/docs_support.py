"""The Python code blocks of a documentation page, as the page shows them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_blocks(page: str) -> list[str]:
    """Each ```python block of docs/`page` (or of the README: `page` relative to the repository), in order."""
    text = (REPO / page).read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
