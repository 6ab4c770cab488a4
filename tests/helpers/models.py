"""A tiny random Llama with a real (tiny, byte-level BPE) tokenizer and a chat template.

Nothing is downloaded: the tokenizer is trained in memory on a few sentences, the model is random.
"""

from __future__ import annotations

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a poem about the sea and the sky.",
    "def add(a, b):\n    return a + b\n",
    "Explain speculative decoding to a child in three sentences.",
    "What is the capital of France? Paris is the capital of France.",
] * 20


def make_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=320, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def make_model(vocab_size: int, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    # a sharper random distribution than the default init, so sampling tests see structure
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def make_engine_model(vocab_size: int, seed: int = 0):
    """A tiny random Llama the CPU engine serves (2 heads of 64: its attention kernels need that head size)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a sharp distribution: greedy ties are rare
    return model
