"""`python -m recipes.gpt2 [overrides]` — see recipes/conf/gpt2.yaml."""

from recipes.main import run_recipe

if __name__ == "__main__":
    run_recipe("gpt2")
