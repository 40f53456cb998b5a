"""Hydra configs of the recipes (one YAML per recipe; base.yaml is shared)."""
