"""`python -m recipes.gpt_tiny [overrides]` — see recipes/conf/gpt_tiny.yaml."""

from recipes.main import run_recipe

if __name__ == "__main__":
    run_recipe("gpt_tiny")
