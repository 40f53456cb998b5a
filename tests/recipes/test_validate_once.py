"""``validate()`` runs once per process (issue 13, item 3): a rank that validated passes its Layout on."""

from parallel.testing import run_ranks
from recipes.config import validate

from .test_train_e2e import tiny_recipe


def _worker_counts_validations(rc, run_dir):
    import recipes.config
    import recipes.main
    import recipes.training.trainer

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return recipes.config.validate(*args, **kwargs)

    recipes.training.trainer.validate = counted
    layout = validate(rc, world_size=1)  # what recipes.main does first under torchrun
    recipes.main.worker(rc, run_dir, layout)
    with_layout = len(calls)
    recipes.training.trainer.Trainer(rc, run_dir)  # a caller without one: the trainer validates itself
    return with_layout, len(calls) - with_layout


def test_the_trainer_does_not_validate_again(tmp_path):
    rc = tiny_recipe(train__max_steps=1)
    [(with_layout, without)] = run_ranks(_worker_counts_validations, 1, rc, str(tmp_path), timeout=300)
    assert (with_layout, without) == (0, 1)
