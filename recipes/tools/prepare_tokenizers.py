"""The tokenizers ``python -m recipes.prepare`` takes, behind one small interface.

A :class:`DocTokenizer` turns a batch of documents into token arrays, each document ended by the
tokenizer's end-of-document id (and begun by its BOS where the tokenizer adds one), so that no two
documents run together. Specs (``--tokenizer``):

* omitted or ``bytes``: UTF-8 bytes, vocabulary 256; a document ends with byte 0 (NUL), which text
  does not contain (:data:`BYTES_EOS`);
* a ``*.json`` file: a Hugging Face ``tokenizers`` tokenizer; its end-of-document token is the one
  ``--eos-token`` names, else the first of :data:`EOS_NAMES` in its vocabulary;
* a folder: a ``transformers`` tokenizer (``AutoTokenizer``, as ``save_pretrained`` writes it), with
  its own BOS and EOS;
* ``tiktoken:<encoding>=<file>``: a tiktoken encoding (``r50k_base``, ``cl100k_base``, ``o200k_base``,
  ...) whose ranks are read from the local ``<file>``; its end-of-text token ends each document.

The optional packages are imported when a spec needs them. Objects are picklable, so the
preparation's worker processes each load the tokenizer once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..training.corpus_format import DataError

BYTES_EOS = 0
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class DocTokenizer:
    """``encode(texts)``: one int array per document, EOS-terminated. ``vocab_size``, ``eos_id``,
    ``bos_id`` (None if it adds none) and ``describe()`` (what ``meta.json`` records)."""

    kind = "bytes"
    vocab_size, eos_id, bos_id = 256, BYTES_EOS, None

    def __init__(self, spec: str | None = None):
        self.spec = spec
        self._impl = None

    def _load(self):
        return None

    @property
    def impl(self):
        if self._impl is None:
            self._impl = self._load()
        return self._impl

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_impl": None}  # each worker loads its own

    def encode(self, texts: list[str | bytes]) -> list[np.ndarray]:
        out = []
        for t in texts:
            b = t if isinstance(t, bytes) else t.encode("utf-8", errors="replace")
            out.append(np.frombuffer(b + bytes([BYTES_EOS]), dtype=np.uint8))
        return out

    def describe(self) -> dict:
        return {"kind": self.kind, "spec": self.spec, "vocab_size": self.vocab_size}

    def _terminated(self, batches: list[list[int]]) -> list[np.ndarray]:
        return [np.asarray(ids + [self.eos_id] if not ids or ids[-1] != self.eos_id else ids) for ids in batches]


class HFTokenizersFile(DocTokenizer):
    kind = "tokenizers"

    def __init__(self, spec: str, eos_token: str | None = None):
        super().__init__(spec)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("a tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
        try:
            tok = Tokenizer.from_file(spec)
        except Exception as e:  # noqa: BLE001 - the library's own error, said in one line
            raise DataError(f"--tokenizer {spec} is not a tokenizers JSON file ({str(e)[:120]})") from None
        vocab = tok.get_vocab(with_added_tokens=True)
        names = (eos_token,) if eos_token else EOS_NAMES
        found = [n for n in names if n in vocab]
        if not found:
            raise DataError(
                f"--tokenizer {spec} has no end-of-document token ({'--eos-token ' + eos_token if eos_token else 'none of ' + ', '.join(EOS_NAMES)}); "
                f"name one of its tokens with --eos-token"
            )
        self.eos_token, self.eos_id = found[0], vocab[found[0]]
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)

    def _load(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.spec)

    def encode(self, texts):
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return self._terminated([e.ids for e in self.impl.encode_batch(texts, add_special_tokens=False)])

    def describe(self) -> dict:
        return {**super().describe(), "eos_token": self.eos_token}


class TransformersFolder(DocTokenizer):
    kind = "transformers"

    def __init__(self, spec: str):
        super().__init__(spec)
        tok = self._load()
        if tok.eos_token_id is None:
            raise DataError(
                f"--tokenizer {spec}: this transformers tokenizer has no eos_token; set one and save it again"
            )
        self.eos_id, self.vocab_size = int(tok.eos_token_id), len(tok)
        probe = tok("a", add_special_tokens=True)["input_ids"]
        self.bos_id = (
            int(tok.bos_token_id) if tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id] else None
        )
        self._impl = tok

    def _load(self):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError("a tokenizer folder needs `transformers`: pip install 'gridtrain[data]'") from None
        try:
            return AutoTokenizer.from_pretrained(self.spec)
        except Exception as e:  # noqa: BLE001
            raise DataError(
                f"--tokenizer {self.spec} is not a transformers tokenizer folder ({str(e)[:120]})"
            ) from None

    def encode(self, texts):
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return self._terminated(self.impl(texts, add_special_tokens=True)["input_ids"])


class Tiktoken(DocTokenizer):
    kind = "tiktoken"

    def __init__(self, spec: str):
        super().__init__(spec)
        enc = self._load()
        self.eos_id, self.vocab_size = enc.eot_token, enc.n_vocab
        self._impl = enc

    def _load(self):
        try:
            import tiktoken
            import tiktoken.load
            import tiktoken_ext.openai_public as public
        except ImportError:
            raise DataError("a tiktoken encoding needs `tiktoken`: pip install 'gridtrain[data]'") from None
        name, _, file = self.spec.removeprefix("tiktoken:").partition("=")
        make = getattr(public, name, None)
        if make is None or not file:
            raise DataError(
                f"--tokenizer {self.spec}: expected tiktoken:<encoding>=<local ranks file>, an encoding of "
                f"{sorted(public.ENCODING_CONSTRUCTORS)}"
            )
        if not Path(file).is_file():
            raise DataError(f"--tokenizer {self.spec}: no such ranks file {file}")
        ranks = tiktoken.load.load_tiktoken_bpe(file)
        original = public.load_tiktoken_bpe
        public.load_tiktoken_bpe = lambda *a, **k: ranks  # the pattern and specials of `name`, our ranks
        try:
            params = make()
        finally:
            public.load_tiktoken_bpe = original
        try:
            return tiktoken.Encoding(**params)
        except AssertionError:  # its explicit vocabulary size disagrees with the file
            raise DataError(
                f"--tokenizer {self.spec}: {file} holds {len(ranks):,} ranks, not the {name} encoding's "
                f"{params.get('explicit_n_vocab', 0) - len(params['special_tokens']):,}; give that encoding's file"
            ) from None

    def encode(self, texts):
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return self._terminated(self.impl.encode_ordinary_batch(texts))


def load_tokenizer(spec: str | None, eos_token: str | None = None) -> DocTokenizer:
    """The tokenizer ``spec`` names (module docstring); :class:`DataError` if it cannot be loaded."""
    if spec is None or spec == "bytes":
        return DocTokenizer()
    if spec.startswith("tiktoken:"):
        return Tiktoken(spec)
    path = Path(spec)
    if path.is_dir():
        return TransformersFolder(spec)
    if path.is_file():
        return HFTokenizersFile(spec, eos_token)
    raise DataError(
        f"--tokenizer {spec}: no such file or folder (give a tokenizer.json, a transformers tokenizer folder, "
        f"tiktoken:<encoding>=<file>, or bytes)"
    )
