"""gridtrain launch (see docs/architecture.md)."""
