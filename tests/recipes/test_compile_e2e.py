"""``train.compile=true`` through the trainer: the same losses as eager, step by step, with ZeRO-3's
hooks, prefetch and frees and full recomputation around the compiled blocks; one log line."""

from parallel.testing import run_ranks

from .test_train_e2e import _train, losses, tiny_recipe

STEPS = 3


def _run(tmp_path, name, **kw):
    rc = tiny_recipe(dp=2, zero=3, model__activation_checkpointing="full", train__max_steps=STEPS, **kw)
    run_ranks(_train, 2, rc, str(tmp_path / name), timeout=300)
    return losses(tmp_path / name)


def test_compiled_zero3_full_recompute_matches_eager_step_by_step(tmp_path, capfd):
    eager_loss, eager_norm = _run(tmp_path, "eager")
    capfd.readouterr()
    loss, norm = _run(tmp_path, "compiled", train__compile=True, train__compile_backend="aot_eager")
    assert len(loss) == STEPS
    for a, b in zip(eager_loss + eager_norm, loss + norm):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))
    said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("torch.compile:")]
    assert len(said) == 1 and "0 graph break(s)" in said[0], said


def test_compiled_fp8_and_packed_documents_at_tp2_sp_match_eager(tmp_path):
    """fp8 (emulated, tensorwise: its amax all-reduces and fp8 all-gathers traced) and document masks
    (built before the compiled blocks) at tp=2 with sequence parallelism: compiled equals eager."""
    from .test_packing import _corpus, _recipe

    corpus = _corpus(tmp_path, "docs", n_docs=60)
    keys = dict(tp=2, parallel__sequence_parallel=True, train__precision="fp8", train__fp8_emulate=True)
    keys |= dict(train__max_steps=STEPS, train__eval_every=0)
    got = {}
    for name, extra in (("eager", {}), ("compiled", dict(train__compile=True, train__compile_backend="aot_eager"))):
        run_ranks(_train, 2, _recipe(corpus, **keys, **extra), str(tmp_path / name), timeout=300)
        got[name] = losses(tmp_path / name)
    assert len(got["eager"][0]) == STEPS
    for a, b in zip(sum(got["eager"], []), sum(got["compiled"], [])):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (got["eager"], got["compiled"])


def test_compiled_moe_at_dp2_ep2_matches_eager_step_by_step(tmp_path, capfd):
    """mixtral_tiny at dp=2 × ep=2 through the trainer: the MoE layers' router and experts compiled (the
    dispatch eager between them, the experts' row count symbolic), the same losses and gradient norms as
    eager, and the run's one line says no graph break."""
    got = {}
    for name, extra in (("eager", {}), ("compiled", dict(train__compile=True, train__compile_backend="aot_eager"))):
        rc = tiny_recipe(dp=2, model__preset="mixtral_tiny", parallel__ep=2, train__max_steps=STEPS, **extra)
        capfd.readouterr()
        run_ranks(_train, 2, rc, str(tmp_path / name), timeout=300)
        got[name] = losses(tmp_path / name)
    assert len(got["eager"][0]) == STEPS
    for a, b in zip(sum(got["eager"], []), sum(got["compiled"], [])):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (got["eager"], got["compiled"])
    said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("torch.compile:")]
    assert len(said) == 1 and "0 graph break(s)" in said[0], said
