"""gridtrain models (see DESIGN.md)."""
