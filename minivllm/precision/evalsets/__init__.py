"""Evaluation sets shipped with minivllm, and their loaders and answer checks.

Four sets, each made by ``python -m minivllm.precision.evalsets.build`` (see README.md in
this folder for how each was made and its license):

* ``qa``: factual questions the float32 embedded model answers correctly (``qa.jsonl``);
* ``passkey``: a five-digit pass key hidden in filler text, 256 to 4096 tokens
  (``passkey.jsonl``);
* ``conversations``: multi-turn chats of at least 10 user turns whose assistant turns the
  float32 reference wrote (``conversations.jsonl``);
* ``corpus``: prose written for this project, for KL and perplexity (``corpus.txt``).
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from importlib import resources
from typing import Optional

EVAL_SETS = ("corpus", "conversations", "passkey", "qa")


def _path(name: str):
    return resources.files(__name__).joinpath(name)


def _jsonl(name: str) -> list[dict]:
    p = _path(name)
    if not p.is_file():
        raise FileNotFoundError(f"{name} is missing from {p.parent}; rebuild the sets with "
                                "`python -m minivllm.precision.evalsets.build`")
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass(frozen=True)
class QAItem:
    id: str
    category: str
    question: str
    answers: tuple[str, ...]
    reference_output: str


@dataclass(frozen=True)
class PasskeyItem:
    id: str
    target_tokens: int      # the length bucket (256 ... 4096)
    num_tokens: int         # actual prompt length with the chat template, embedded tokenizer
    depth: float            # where the key sits in the filler, 0 = start, 1 = end
    passkey: str
    prompt: str             # the user message
    reference_output: str


def load_qa() -> list[QAItem]:
    return [QAItem(d["id"], d["category"], d["question"], tuple(d["answers"]),
                   d["reference_output"]) for d in _jsonl("qa.jsonl")]


def load_passkey() -> list[PasskeyItem]:
    return [PasskeyItem(d["id"], d["target_tokens"], d["num_tokens"], d["depth"], d["passkey"],
                        d["prompt"], d["reference_output"]) for d in _jsonl("passkey.jsonl")]


def load_conversations() -> list[list[dict]]:
    """Each conversation: a list of {"role", "content"} messages, user first, alternating."""
    return [d["messages"] for d in _jsonl("conversations.jsonl")]


def load_corpus() -> str:
    return _path("corpus.txt").read_text(encoding="utf-8")


# --- token sequences for teacher-forced scoring ---------------------------------------

def corpus_sequences(tokenizer, seq_len: int = 512, max_sequences: Optional[int] = None
                     ) -> list[list[int]]:
    """The corpus tokenized once and cut into consecutive windows of ``seq_len`` tokens
    (the last, shorter window is dropped if it is under half the length).

    Raises:
        ValueError: seq_len < 2.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    ids = tokenizer.encode(load_corpus(), add_special_tokens=False)
    seqs = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    if len(seqs) > 1 and len(seqs[-1]) < seq_len // 2:
        seqs.pop()
    return seqs[:max_sequences] if max_sequences is not None else seqs


def conversation_sequences(tokenizer, max_conversations: Optional[int] = None,
                           max_tokens: Optional[int] = None) -> list[list[int]]:
    """Whole conversations as chat-template token ids (what a serving engine holds in its
    KV cache at the last turn). ``max_tokens`` keeps the first tokens of each."""
    convs = load_conversations()[:max_conversations]
    out = []
    for conv in convs:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(ids[:max_tokens] if max_tokens else ids)
    return out


def assistant_turn_spans(tokenizer, conversation: list[dict]) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of each assistant message's content inside
    ``conversation_sequences``-style token ids (chat template, no generation prompt).

    Found by rendering the conversation up to each message; raises ValueError if the
    template does not render prefixes consistently (then spans would be wrong).
    """
    def n_tokens(msgs, gen):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        return len(tokenizer.encode(text, add_special_tokens=False))

    full = n_tokens(conversation, False)
    spans = []
    for i, m in enumerate(conversation):
        if m["role"] != "assistant":
            continue
        start = n_tokens(conversation[:i], True)
        end = n_tokens(conversation[:i + 1], False)
        if not start < end <= full:
            raise ValueError(f"chat template does not render prefixes consistently "
                             f"(turn {i}: {start}..{end} of {full})")
        spans.append((start, end))
    return spans


# --- answer checks ----------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation if c not in "-,"})


def normalize_answer(text: str) -> str:
    """Lower case, punctuation (except hyphens and digit commas) to spaces, articles
    removed, whitespace collapsed (the SQuAD normalization, keeping "twenty-four" and
    "300,000" intact)."""
    text = text.lower().translate(_PUNCT)
    text = re.sub(r",(?!\d)", " ", text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_matches(output: str, answers) -> bool:
    """True if any accepted answer appears in the output as whole words, after
    :func:`normalize_answer` on both."""
    out = f" {normalize_answer(output)} "
    return any(f" {normalize_answer(a)} " in out for a in answers if normalize_answer(a))


def passkey_correct(output: str, passkey: str) -> bool:
    """The five-digit key appears in the output as a number of its own."""
    return re.search(rf"(?<!\d){re.escape(passkey)}(?!\d)", output) is not None


def chat_prompt_ids(tokenizer, conversation: list[dict]) -> list[int]:
    """Token ids of ``conversation`` rendered by the tokenizer's chat template with the
    generation prompt, as a served chat request sees them (the template holds any BOS, so
    ``encode`` adds none)."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def qa_prompt(question: str) -> list[dict]:
    """The chat used for every QA item."""
    return [{"role": "user", "content": f"Answer in a few words. {question}"}]
