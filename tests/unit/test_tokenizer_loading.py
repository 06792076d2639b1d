"""load_tokenizer: the bundled model's tokenizer loads without torch (the tokenizer and gateway processes never run
the model) and is the one transformers' AutoTokenizer gives."""

from __future__ import annotations

import subprocess
import sys

from shared.text.tokenization import load_tokenizer

TEXTS = ["Hello, world!", "  two spaces, a tab\tand ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_the_bundled_models_tokenizer_loads_without_importing_torch(model_dir):
    code = (
        "import sys; from pathlib import Path; from shared.text.tokenization import load_tokenizer; "
        f"load_tokenizer(Path({str(model_dir)!r})); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_loaded_tokenizer_encodes_decodes_and_templates_as_autotokenizers(model_dir):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(auto)
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    assert len(ours) == len(auto)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == auto.encode(text) and ours.decode(ids) == auto.decode(ids), text
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == auto.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )


def test_a_folder_conveyor_did_not_convert_goes_through_autotokenizer(model_dir, tmp_path, monkeypatch):
    """A user's own folder may name any class or ship code of its own: AutoTokenizer decides, as transformers does."""
    from transformers import AutoTokenizer

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / f).exists():
            (tmp_path / f).write_bytes((model_dir / f).read_bytes())
    calls = []
    original = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append(path) or original(path, **kw))
    tok = load_tokenizer(tmp_path)
    assert calls == [str(tmp_path)] and tok.encode(TEXTS[0]) == load_tokenizer(model_dir).encode(TEXTS[0])
