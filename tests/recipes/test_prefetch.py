"""The background read of the next step's batch: the same batches, in any order asked, errors raised
where the step asks for them."""

import threading

import pytest

from recipes.training.prefetch import Prefetcher


def test_reads_ahead_on_another_thread_and_returns_what_read_returns():
    threads, calls = [], []

    def read(step):
        threads.append(threading.current_thread().name)
        calls.append(step)
        return [step * 10]

    p = Prefetcher(read)
    assert [p.get(s) for s in (0, 1, 2)] == [[0], [10], [20]]
    assert p.get(7) == [70]  # out of order (a resume): read at once, then 8 ahead
    assert p.get(8) == [80]
    p.close()
    assert calls.count(1) == calls.count(2) == calls.count(8) == 1  # read ahead once, not again
    assert any(name.startswith("gridtrain-data") for name in threads)


def test_an_error_in_a_read_ahead_is_raised_by_the_step_that_asks_for_it():
    def read(step):
        if step == 2:
            raise ValueError("token id 900 ≥ vocab")
        return step

    p = Prefetcher(read)
    assert p.get(1) == 1  # step 2 fails in the background, unseen yet
    with pytest.raises(ValueError, match="token id 900"):
        p.get(2)
    p.close()


def test_the_trainer_reads_the_same_batches_with_and_without_the_thread():
    from parallel.testing import run_ranks

    assert all(run_ranks(_same_batches, 1, timeout=120))


def _same_batches():
    import tempfile

    from recipes.training.trainer import Trainer
    from tests.recipes.test_train_e2e import tiny_recipe

    tr = Trainer(tiny_recipe(), run_dir=tempfile.mkdtemp())
    ahead = [tr.microbatches(s) for s in (0, 1, 2, 5, 6)]
    direct = [tr.host_microbatches(s) for s in (0, 1, 2, 5, 6)]
    tr.prefetch.close()
    return all(all(x.equal(hx) and y.equal(hy) for x, y, (hx, hy) in zip(a[0], a[1], d)) for a, d in zip(ahead, direct))
