"""gridtrain recipes (see docs/architecture.md)."""
