"""``stepwatch run`` and ``stepwatch dump`` (docs/hang.md)."""
