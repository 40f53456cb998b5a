"""gridtrain recipes (see DESIGN.md)."""
