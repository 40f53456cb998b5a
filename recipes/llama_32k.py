"""`python -m recipes.llama_32k [overrides]` — see recipes/conf/llama_32k.yaml (docs/cp.md)."""

from recipes.main import run_recipe

if __name__ == "__main__":
    run_recipe("llama_32k")
