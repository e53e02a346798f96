"""The data package's error type, and how every data error names a row.

    python -m pytest tests/test_data.py -q -k "name_their or names_file"
"""


class DataError(ValueError):
    """A problem with the data set or its sizes; the message says what to change."""


def row_name(source: str, row: int) -> str:
    """How every error names a row: '<source> row <1-based row>' (the line of a jsonl file)."""
    return f"{source} row {int(row) + 1}"
