"""`python -m recipes.gpt175b [overrides]` — see recipes/conf/gpt175b.yaml."""

from recipes.main import run_recipe

if __name__ == "__main__":
    run_recipe("gpt175b")
