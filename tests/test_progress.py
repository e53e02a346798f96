"""The start and end lines of a long phase (common/progress.py), and that train_fsdp.py prints them.

    python -m pytest tests/test_progress.py -q
"""

import pytest

from common.progress import phase


def test_a_phase_says_what_starts_and_how_long_it_took():
    lines = []
    with phase(lines.append, "resume: loading step-000004"):
        assert lines == ["resume: loading step-000004 ..."]
    assert len(lines) == 2 and lines[1].startswith("resume: loading step-000004: done in ")
    assert lines[1].endswith("s")


def test_a_failed_phase_prints_no_end_line():
    lines = []
    with pytest.raises(OSError):
        with phase(lines.append, "export: writing step 5 to out"):
            raise OSError("disk full")
    assert lines == ["export: writing step 5 to out ..."]
