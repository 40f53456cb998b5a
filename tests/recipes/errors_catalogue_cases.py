"""The error catalogue's cases: the bad inputs a first-time user tries and the key each must name.

Data only; ``test_errors_catalogue.py`` runs every entry through the real CLI entry and
generates ``docs/errors.md`` from ``CATALOGUE`` (in this order).
"""

from __future__ import annotations

# (overrides, the key the last line must name, environment); {name} is a fixture path (see test_errors_catalogue._fixtures)
TORCHRUN_RANK1 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
CATALOGUE: list[tuple[list[str], str, dict]] = [
    # unknown keys, in every form
    (["+parallel.tpp=2"], "parallel.tpp", {}),
    (["+foo=1"], "foo", {}),
    (["++train.max_step=5"], "train.max_step", {}),
    (["+model.dropout=0.1"], "model.dropout", {}),
    (["parallel.tpp=2"], "parallel.tpp", {}),
    (["foo=1"], "foo", {}),
    (["trian.max_steps=5"], "trian.max_steps", {}),
    (["optim.learning_rate=1e-3"], "optim.learning_rate", {}),
    (["~parallel.tpp"], "parallel.tpp", {}),
    # values of the wrong type
    (["train.max_steps=abc"], "train.max_steps", {}),
    (["parallel.tp=two"], "parallel.tp", {}),
    (["optim.lr=fast"], "optim.lr", {}),
    (["train.ckpt_at_end=maybe"], "train.ckpt_at_end", {}),
    # optimizer
    (["optim.lr=-0.01"], "optim.lr", {}),
    (["optim.lr=nan"], "optim.lr", {}),
    (["optim.lr=inf"], "optim.lr", {}),
    (["optim.lr=0"], "optim.lr", {}),
    (["optim.min_lr=1"], "optim.min_lr", {}),
    (["optim.betas=[2.0,0.5]"], "optim.betas", {}),
    (["optim.betas=[0.9]"], "optim.betas", {}),
    (["optim.eps=0"], "optim.eps", {}),
    (["optim.weight_decay=-0.1"], "optim.weight_decay", {}),
    (["optim.warmup_steps=-5"], "optim.warmup_steps", {}),
    (["optim.name=lamb"], "optim.name", {}),
    (["optim.schedule=step"], "optim.schedule", {}),
    # training loop
    (["train.eval_every=-1"], "train.eval_every", {}),
    (["train.threads=-1"], "train.threads", {}),
    (["train.grad_clip=-1"], "train.grad_clip", {}),
    (["train.max_steps=0"], "train.max_steps", {}),
    (["train.global_batch=30"], "train.global_batch", {}),
    (["train.micro_batch=0"], "train.micro_batch", {}),
    (["train.precision=fp8"], "train.precision", {}),
    (["train.eval_batches=0"], "train.eval_batches", {}),
    (["train.ckpt_every=-1"], "train.ckpt_every", {}),
    (["train.fault=boom"], "train.fault", {}),
    (["train.sigterm_grace_s=0"], "train.sigterm_grace_s", {}),
    (["train.log_every=0"], "train.log_every", {}),
    # communication
    (["comm.bucket_mb=0"], "comm.bucket_mb", {}),
    (["comm.topk_ratio=2"], "comm.topk_ratio", {}),
    (["comm.compression=topk", "parallel.zero=1"], "comm.compression", {}),
    (["parallel.zero3_accumulate=unsharded", "parallel.zero=1"], "parallel.zero3_accumulate", {}),
    (["comm.dtype=int8"], "comm.dtype", {}),
    # layout
    (["parallel.order=bogus"], "parallel.order", {}),
    (["parallel.order=tp-tp-pp"], "parallel.order", {}),
    (["parallel.tp=3"], "parallel.tp", {}),
    (["parallel.pp=5"], "parallel.pp", {}),
    (["parallel.vpp=2"], "parallel.vpp", {}),
    (["model.n_layers=6", "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.vpp=2"], "parallel.vpp", {}),
    (["parallel.pp_schedule=zigzag"], "parallel.pp_schedule", {}),
    (["parallel.zero=4"], "parallel.zero", {}),
    (["parallel.backend=nccl"], "parallel.backend", {}),
    (["parallel.backend=mpi"], "parallel.backend", {}),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", {}),
    (["parallel.dp=0"], "parallel.dp", {}),
    (["parallel.mp=2", "parallel.tp=4"], "parallel.mp", {}),
    (["parallel.pp=2", "parallel.pp_layers=[1,2]"], "parallel.pp_layers", {}),
    (["parallel.timeout_s=0"], "parallel.timeout_s", {}),
    (["parallel.gpus_per_node=0"], "parallel.gpus_per_node", {}),
    # model
    (["model.preset=gpt5"], "model.preset", {}),
    (["model.seq_len=300000"], "model.seq_len", {}),
    (["model.n_heads=3"], "model.n_heads", {}),
    (["model.vocab_size=0"], "model.vocab_size", {}),
    (["model.arch=rnn"], "model.arch", {}),
    # data
    (["data.source=s3"], "data.source", {}),
    (["data.source=memmap"], "data.path", {}),
    (["data.val_fraction=1.0"], "data.val_fraction", {}),
    (["data.val_fraction=0"], "data.val_fraction", {}),
    (["data.embedded_mb=0"], "data.embedded_mb", {}),
    (["data.embedded_mb=0.001"], "data.embedded_mb", {}),
    (["data.source=memmap", "data.path={missing}"], "data.path", {}),
    (["data.source=memmap", "data.path={a_file}"], "data.path", {}),
    (["data.source=memmap", "data.path={empty_dir}"], "data.path", {}),
    (["data.source=memmap", "data.path={bad_json}"], "data.path", {}),
    (["data.source=memmap", "data.path={no_dtype}"], "data.path", {}),
    (["data.source=memmap", "data.path={empty_train}"], "data.path", {}),
    (["data.source=memmap", "data.path={odd_bytes}"], "data.path", {}),
    (["data.source=memmap", "data.path={short_of_header}"], "data.path", {}),
    (["data.source=memmap", "data.path={big_vocab}"], "data.path", {}),
    (["data.source=memmap", "data.path={id_over_vocab}"], "data.path", {}),
    (["data.source=memmap", "data.path={small_val}"], "data.path", {}),
    (["data.source=memmap", "data.path={no_val}"], "data.path", {}),
    # DeepSpeed JSON
    (["deepspeed={empty_dir}"], "deepspeed", {}),
    (["deepspeed={missing}.json"], "deepspeed", {}),
    (["deepspeed={ds_bad}"], "deepspeed", {}),
    (["deepspeed={ds_list}"], "deepspeed", {}),
    (["deepspeed={ds_unknown}"], "deepspeed", {}),
    (["deepspeed={ds_auto}"], "deepspeed", {}),
    (["deepspeed={ds_bad_lr}"], "optim.lr", {}),
    # resume target
    (["train.resume={missing}"], "train.resume", {}),
    (["train.resume={a_file}"], "train.resume", {}),
    (["train.resume={empty_dir}"], "train.resume", {}),
    (["train.resume={ckpt}", "model.d_model=64"], "train.resume", {}),
    (["train.resume={ckpt}", "model.n_layers=2"], "train.resume", {}),
    (["train.resume={ckpt}", "model.n_layers=6"], "train.resume", {}),
    (["train.resume={ckpt_flipped}"], "train.resume", {}),
    (["train.resume={ckpt_no_shard}"], "train.resume", {}),
    (["train.resume={ckpt_short_metadata}"], "train.resume", {}),
    (["train.resume={ckpt_bad_manifest}"], "train.resume", {}),
    (["train.resume={run_bad_latest}"], "train.resume", {}),
    (["train.resume={run_empty_latest}"], "train.resume", {}),
    # the same checks on a torchrun rank (rank 1 of 2), before it joins the process group
    (["optim.lr=-1"], "optim.lr", TORCHRUN_RANK1),
    (["data.source=memmap", "data.path={missing}"], "data.path", TORCHRUN_RANK1),
    (["train.resume={ckpt_flipped}"], "train.resume", TORCHRUN_RANK1),
]
# a few through a fresh interpreter, exactly as a user types them
SUBPROCESS = [
    (["+parallel.tpp=2"], "parallel.tpp"),
    (["optim.lr=nan"], "optim.lr"),
    (["data.source=memmap", "data.path={missing}"], "data.path"),
    (["train.resume={ckpt_flipped}"], "train.resume"),
    (["deepspeed={empty_dir}"], "deepspeed"),
]
