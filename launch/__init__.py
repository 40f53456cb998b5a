"""gridtrain launch (see DESIGN.md)."""
