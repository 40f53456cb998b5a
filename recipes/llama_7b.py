"""`python -m recipes.llama_7b [overrides]` — see recipes/conf/llama_7b.yaml."""

from recipes.main import run_recipe

if __name__ == "__main__":
    run_recipe("llama_7b")
