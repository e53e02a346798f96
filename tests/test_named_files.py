"""Every repository file a docstring or comment names exists: ckpt/storage/base.py sent readers to the exporter's
old path after it moved to ckpt/hf/export.py (newcomer study 2026-11-28).

    python -m pytest tests/test_named_files.py -q

It reads the comments and the module, class and function docstrings of every tracked .py file and checks each
path under a top-level folder of this repository (ckpt/, finetune/, common/, tests/, bench/, docs/, slurm/,
configs/, assets/, data/) that ends in a file extension or '/'.
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FOLDERS = "ckpt|finetune|common|tests|bench|docs|slurm|configs|assets|data"
_EXTENSIONS = "py|md|yaml|yml|sh|sbatch|json|jsonl|txt"
# A path starts a word (not inside /tmp/ckpt/x.py or <run.dir>/data/) and ends in an extension or a '/'.
NAMED_PATH = re.compile(rf"(?<![\w/.<>-])((?:{_FOLDERS})/(?:[\w/.-]*?\.(?:{_EXTENSIONS})\b|[\w/.-]*/))")
# Names of files that are gone on purpose, and why they may still be named.
GONE_ON_PURPOSE = {
    "finetune/data.py": "bench/data_bench.py measures the tokenizer of finetune/data.py as of an old commit "
                        "(git show <commit>:finetune/data.py)",
}


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring of a Python source."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    return out


def missing_names(source: str, exists=lambda p: os.path.exists(os.path.join(ROOT, p))) -> list[tuple[int, str]]:
    """(line, path) of each repository path the comments and docstrings of `source` name that does not exist."""
    return [(line, path) for line, text in comments_and_docstrings(source) for path in NAMED_PATH.findall(text)
            if path not in GONE_ON_PURPOSE and not exists(path)]


def test_docstrings_and_comments_name_only_files_that_exist():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    bad = []
    for name in tracked:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            bad += [f"{name}:{line}: {path}" for line, path in missing_names(f.read())]
    assert not bad, "these comments or docstrings name files that do not exist:\n" + "\n".join(bad)


def test_the_check_finds_a_moved_file_and_skips_what_is_no_path():
    source = ('"""Export: ckpt/export.py writes it; /tmp/ckpt/x.py and <run.dir>/data/ are not repo paths."""\n'
              'x = "ckpt/gone.py"  # a string, not a comment\n'
              '# see ckpt/hf/export.py and docs/missing.md\n')
    found = missing_names(source, exists=lambda p: p == "ckpt/hf/export.py")
    assert found == [(3, "docs/missing.md"), (1, "ckpt/export.py")], found
