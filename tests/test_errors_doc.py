"""docs/errors.md lists every refusal the tests assert: each message fragment a test hands to one of
the one-line-refusal checks (``_refused``, ``assert_refused``, ``assert_one_line_failure``) as a
plain string appears in docs/errors.md, backticks and line breaks aside (issue 26, item 8)."""

import ast
import re
from pathlib import Path

import kvemu.errors

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {"_refused", "assert_refused", "assert_one_line_failure"}
#: a leading file name is the example's own (`t.parquet: …`), not part of the message
FILE_PREFIX = re.compile(r"^\S+\.(parquet|toml|json|jsonl|csv|html): ")
REGEX = re.compile(r"\\|\(\?|\|.*\)")  # a regular expression handed to re.search, not a message


def _norm(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def asserted_messages():
    """(file, line, fragment) of every plain-string message fragment the tests assert."""
    for f in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name not in CHECKS:
                continue
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and len(a.value) > 12 \
                        and not REGEX.search(a.value):
                    yield f.name, node.lineno, FILE_PREFIX.sub("", a.value)


def test_every_refusal_a_test_asserts_is_in_docs_errors_md():
    doc = _norm((ROOT / "docs" / "errors.md").read_text())
    found = list(asserted_messages())
    assert len(found) > 30  # the extraction sees the hostile-input tests
    missing = [(f, line, text) for f, line, text in found if _norm(text) not in doc]
    assert missing == [], missing


def test_every_error_class_is_in_the_table():
    doc = (ROOT / "docs" / "errors.md").read_text()
    classes = [n for n, c in vars(kvemu.errors).items()
               if isinstance(c, type) and issubclass(c, kvemu.errors.KvemuError) and c is not kvemu.errors.KvemuError]
    assert classes
    missing = [n for n in classes if f"`{n}`" not in doc]
    assert missing == [], missing
