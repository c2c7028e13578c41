"""The reference: HF transformers on the same weights, float32 or float64.

The course's ground truth (DESIGN principle 5). Everything here is plain transformers
code (``AutoModelForCausalLM``), so a difference against minivllm is a difference in our
engine, not in the yardstick.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float64": torch.float64,
           "double": torch.float64}


class ReferenceModel:
    """HF ``LlamaForCausalLM`` (or any causal LM transformers loads) for scoring and
    greedy generation.

    Args:
        model: a local HF folder or the alias ``smollm2-135m-instruct``.
        dtype: "float32" or "float64".
        device: torch device string.
        attn_implementation: transformers attention ("sdpa" by default, "eager" to see
            every operation in plain PyTorch).
    Raises:
        ValueError: an unsupported dtype (allowed: float32, float64).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", dtype: str = "float32",
                 device: str = "cpu", attn_implementation: str = "sdpa"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from minivllm.models.loader import resolve_model_path

        if dtype not in _DTYPES:
            raise ValueError(f"reference dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        path = str(resolve_model_path(model))
        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation=attn_implementation,
        ).to(self.device).eval()  # type: ignore[arg-type]  # transformers' typing of .to
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], output: str = "logprobs") -> torch.Tensor:
        """Teacher-forced scores of one sequence, the same rows as ``LLM.score``.

        Returns:
            ``[T, vocab]`` on CPU, float32 or float64 (the reference dtype); row t is the
            distribution of the token after position t.
        Raises:
            ValueError: empty sequence or an unknown output.
        """
        if output not in ("logprobs", "logits"):
            raise ValueError(f"output must be 'logprobs' or 'logits', got {output!r}")
        ids = torch.as_tensor(self._check_ids(token_ids), dtype=torch.int64, device=self.device)
        if ids.numel() == 0:
            raise ValueError("cannot score an empty token sequence")
        logits = self.model(input_ids=ids[None]).logits[0]
        if output == "logprobs":
            logits = torch.log_softmax(logits, dim=-1)
        return logits.cpu()

    @torch.inference_mode()
    def generate(self, prompts: Union[Sequence[int], Sequence[Sequence[int]]],
                 max_tokens: int, ignore_eos: bool = False) -> Union[list[int], list[list[int]]]:
        """Greedy generation (transformers ``generate``, ``do_sample=False``).

        Args:
            prompts: token ids of one prompt or of several (left-padded into one batch).
            max_tokens: new tokens at most (exactly this many with ``ignore_eos``).
        Returns:
            the new token ids (without the prompt, EOS kept if it was generated), one list
            per prompt, or one list for a single prompt.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        seqs: list = list(prompts)
        single = bool(seqs) and not isinstance(seqs[0], (list, tuple))
        if single:
            seqs = [seqs]
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("every prompt needs at least one token")
        seqs = [self._check_ids(s) for s in seqs]
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(seqs), width), dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(list(s))
            mask[i, width - len(s):] = 1
        kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
                  temperature=None, top_p=None, top_k=None)
        if ignore_eos:
            kw["min_new_tokens"] = max_tokens
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        eos = set(self._eos_ids())
        results = []
        for row in out[:, width:].tolist():
            kept = []
            for t in row:
                kept.append(t)
                if not ignore_eos and t in eos:
                    break
            results.append(kept)
        return results[0] if single else results

    def _check_ids(self, token_ids) -> list[int]:
        """Plain int token ids in [0, vocab) (numpy integers accepted; bools, floats and
        nested lists rejected)."""
        vocab = self.model.config.vocab_size
        out = []
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab:
                raise ValueError(f"token ids must be integers in [0, {vocab}), got {t!r}")
            out.append(int(t))
        return out

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def encode_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    chat_template: Optional[str] = None) -> list[int]:
        """Token ids of a conversation with the model's chat template (no extra BOS)."""
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template)
        return self.tokenizer.encode(text, add_special_tokens=False)
