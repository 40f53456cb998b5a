"""Exact resume and resharding through the trainer (docs/architecture.md invariant 1 across a restart)."""

import pytest

from parallel.checkpoint import latest_checkpoint, read_manifest
from parallel.testing import run_ranks

from .test_train_e2e import _train, losses, tiny_recipe

SAVED = dict(dp=2, pp=2, tp=2, zero=1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(2,2,2) ZeRO-1 for 6 steps, saving at step 4 (and every 4th): the reference and the checkpoint."""
    d = tmp_path_factory.mktemp("full")
    run_ranks(_train, 8, tiny_recipe(**SAVED, train__max_steps=6, train__ckpt_every=4), str(d), timeout=300)
    return d, losses(d)[0]


def test_checkpoint_records_step_layout_and_config(uninterrupted):
    run_dir, _ = uninterrupted
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    manifest = read_manifest(ckpt)
    assert ckpt.name == "step_00000004" and manifest["step"] == 4
    assert {k: manifest["meta"]["layout"][k] for k in SAVED} == SAVED
    assert manifest["meta"]["config"]["model"]["d_model"] == 64
    assert sorted(p.name for p in ckpt.glob("__*.distcp")) == [f"__{r}_0.distcp" for r in range(8)]


def test_same_layout_resume_is_bit_exact(uninterrupted, tmp_path):
    run_dir, full = uninterrupted
    rc = tiny_recipe(**SAVED, train__max_steps=6, train__resume=str(run_dir / "checkpoints"))
    summary = run_ranks(_train, 8, rc, str(tmp_path), timeout=300)[0]
    assert summary["steps"] == 6
    assert losses(tmp_path)[0] == full[4:6]  # steps 5 and 6, bit for bit


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=4, pp=1, tp=2, zero=1),
        dict(dp=1, pp=2, tp=4, zero=1),
        dict(dp=2, pp=2, tp=2, zero=3),
        dict(dp=2, pp=2, tp=1, zero=2, parallel__pp_schedule="interleaved", parallel__vpp=2),  # 4 ranks, vpp
    ],
    ids=lambda d: "dp{dp}-pp{pp}-tp{tp}-zero{zero}".format(**d) + ("-vpp2" if "parallel__vpp" in d else ""),
)
def test_other_layout_resumes_within_1e4(uninterrupted, tmp_path, layout):
    """The next step's loss (step 5) is computed before step 5's update, so one step suffices
    (max_steps=5 changes only the learning rate of that update)."""
    run_dir, full = uninterrupted
    rc = tiny_recipe(**layout, train__max_steps=5, train__resume=str(run_dir / "checkpoints" / "step_00000004"))
    run_ranks(_train, layout["dp"] * layout["pp"] * layout["tp"], rc, str(tmp_path), timeout=300)
    got = losses(tmp_path)[0]
    assert len(got) == 1 and got[0] == pytest.approx(full[4], abs=1e-4)


def _full_params_after_load(rc, run_dir, ckpt):
    from recipes.training.trainer import Trainer

    trainer = Trainer(rc, run_dir)
    trainer.load_state_dict(ckpt)
    names = trainer.engine.model.global_names()
    return {names[k]: v for k, v in trainer.engine.zero.full_parameters().items()}


def test_inspect_lists_it_and_exports_what_a_loaded_trainer_holds(uninterrupted, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    from models.hf import load_hf_weights
    from models.transformer import build_model
    from recipes.tools.inspect_checkpoint import main, saved_model_config

    run_dir, _ = uninterrupted
    assert main([str(run_dir), "--consolidated", str(tmp_path / "all.safetensors"), "--hf", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "step 4, saved by 8 ranks" in out and "dp=2 pp=2" in out
    assert "model/blocks.3.attn.q_proj.weight" in out and "optim/blocks.3.attn.q_proj.weight/exp_avg_sq" in out
    consolidated = load_file(str(tmp_path / "all.safetensors"))
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    (run_dir / "one").mkdir()
    full = run_ranks(_full_params_after_load, 1, tiny_recipe(), str(run_dir / "one"), ckpt, timeout=120)[0]
    assert sorted(full) == sorted(consolidated)
    for name, t in consolidated.items():  # ZeRO's own gather after our resharding load == DCP's whole tensors
        assert torch.equal(full[name][: t.shape[0]], t), name
    stage = build_model(saved_model_config(ckpt), device="cpu", dtype=torch.float32, seed=99)
    load_hf_weights(stage, str(tmp_path / "hf"))
    for name, p in stage.named_parameters():
        assert torch.equal(p.detach()[: consolidated[name].shape[0]], consolidated[name]), name
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))  # config.json written too
    ids = torch.randint(0, 256, (1, 8))
    ours = stage(ids)[..., :256]
    torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=1e-4)
    assert main([str(tmp_path / "nothing-here")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def _train_late(rc, run_dir):
    from parallel import comm

    with comm.late_completion():  # collectives return once queued, as under NCCL
        return _train(rc, run_dir)


def test_training_and_saving_are_unchanged_when_collectives_complete_late(uninterrupted, tmp_path):
    """No host code of the step or the save relies on a queued collective having finished."""
    run_ranks(_train_late, 8, tiny_recipe(**SAVED, train__max_steps=4, train__ckpt_every=4), str(tmp_path), timeout=300)
    assert losses(tmp_path)[0] == uninterrupted[1][:4]
    assert read_manifest(latest_checkpoint(tmp_path / "checkpoints"))["step"] == 4
