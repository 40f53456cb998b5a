"""`python -m recipes.deepseek_v3 [overrides]` — see recipes/conf/deepseek_v3.yaml."""

from recipes.main import run_recipe

if __name__ == "__main__":
    run_recipe("deepseek_v3")
