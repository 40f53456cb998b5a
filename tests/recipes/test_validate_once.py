"""``validate()`` runs once per process (issue 13, item 3): a rank that validated passes its Layout on."""

from parallel.testing import run_ranks
from recipes.config import validate

from .test_train_e2e import tiny_recipe


def _worker_counts_validations(rc, run_dir):
    import gc

    import recipes.config
    import recipes.main
    import recipes.training.trainer

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return recipes.config.validate(*args, **kwargs)

    recipes.training.trainer.validate = counted
    layout = validate(rc, world_size=1)  # what recipes.main does first under torchrun
    gc.unfreeze()
    recipes.main.worker(rc, run_dir, layout)
    frozen = gc.get_freeze_count()  # a finished worker leaves its heap to the exit, not the collector
    with_layout = len(calls)
    recipes.training.trainer.Trainer(rc, run_dir)  # a caller without one: the trainer validates itself
    return with_layout, len(calls) - with_layout, frozen > 0


def test_the_trainer_does_not_validate_again(tmp_path):
    rc = tiny_recipe(train__max_steps=1)
    [(with_layout, without, frozen)] = run_ranks(_worker_counts_validations, 1, rc, str(tmp_path), timeout=300)
    assert (with_layout, without) == (0, 1)
    assert frozen  # recipes.training.exits.freeze_for_exit
