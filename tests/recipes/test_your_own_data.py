"""README's "Your own data": its three commands, run as written on a jsonl folder and a transformers
tokenizer folder made here, end in a falling loss curve."""

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.recipes.test_prepare import DOCS, _bpe

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own data") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.strip().splitlines() if line.strip()]


def test_the_readme_commands_train_on_a_jsonl_folder_with_a_transformers_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    install, prepare_cmd, train_cmd = readme_commands()
    assert install == 'pip install -e ".[data]"'  # what .ci/run installs already (dev includes data)
    corpus = tmp_path / "my_corpus"
    corpus.mkdir()
    for part in range(2):
        lines = [json.dumps({"text": d * 3, "id": i}) for i, d in enumerate(DOCS[part::2] * 4)]
        (corpus / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
    tok, _ = _bpe(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(
        tmp_path / "my_tokenizer"
    )

    def run(cmd: str, *extra: str) -> subprocess.CompletedProcess:
        args = cmd.replace("my_corpus/", f"{corpus}/").replace("my_tokenizer/", f"{tmp_path}/my_tokenizer/")
        args = args.replace("data/mine", str(tmp_path / "mine")).split()
        assert args[0] == "python"
        return subprocess.run(
            [sys.executable, *args[1:], *extra], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
        )

    p = run(prepare_cmd, "--workers", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    vocab = json.loads((tmp_path / "mine" / "meta.json").read_text())["vocab_size"]
    assert f"model.vocab_size={vocab}" in p.stdout
    steps = ["train.max_steps=30", "train.eval_every=0", "logger.progress=false", "train.log_every=1"]
    steps += ["model.seq_len=64", "train.global_batch=8", "train.micro_batch=8", "train.ckpt_every=0"]
    p = run(train_cmd.replace("VOCAB", str(vocab)), *steps, f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    loss, epochs = [r["loss"] for r in rows], [r["epoch"] for r in rows]  # prepared data is read in epochs
    assert epochs == sorted(epochs) and epochs[0] > 0
    assert len(loss) == 30 and sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.5, loss
