"""The one plural rule of every count printed to a person: "1 rank", "2 ranks", "28 bytes entries".

    python -c "from common.words import plural; print(plural(1, 'rank'), plural(3, 'item'))"
"""

from __future__ import annotations


def plural(n, noun: str, nouns: str | None = None) -> str:
    """`n noun` for n == 1, else `n nouns` (default noun + "s"); `n` printed as given (int or '?')."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
