"""A tiny random Llama checkpoint (HF folder) with a small byte-level BPE tokenizer.

Used by unit tests so they run in seconds and compare against transformers'
``LlamaForCausalLM`` on identical random weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Floating point numbers have a sign, an exponent and a mantissa.",
    "Once upon a time there was a tiny language model that liked numbers.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"",
] * 20


def make_tokenizer(out: Path, vocab_size: int = 384):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_CORPUS, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, unk_token="<unk>",
                                  bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return tok


def make_tiny_llama(out: Path, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 512, rope_theta: float = 10000.0,
                    tie_word_embeddings: bool = True, dtype: str = "float32") -> Path:
    """Write a random Llama HF folder (config, safetensors, tokenizer) to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size,
                      intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                      tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger-than-default weights so logits are not all near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return out
