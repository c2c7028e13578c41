"""minivllm.tokenizer.truncate_by_turns_ref: the reference of chapter 26's fix (and lab
26's grader), checked with a render whose lengths are known by construction."""

from __future__ import annotations

from minivllm.tokenizer import truncate_by_turns_ref


def _render(conversation):
    """One id per character of each message, plus 2 around each: lengths are exact."""
    return [0] * sum(len(m["content"]) + 2 for m in conversation)


SYS = {"role": "system", "content": "s" * 8}                      # 10 ids
CHAT = [SYS, {"role": "user", "content": "u" * 18}, {"role": "assistant", "content": "a" * 18},
        {"role": "user", "content": "v" * 8}, {"role": "assistant", "content": "b" * 8},
        {"role": "user", "content": "q" * 3}]                     # 10 + 40 + 20 + 5 = 75


def test_whole_chat_at_its_length_and_one_under():
    assert truncate_by_turns_ref(CHAT, _render, 75) == CHAT
    assert truncate_by_turns_ref(CHAT, _render, 74) == [SYS] + CHAT[3:]


def test_oldest_turns_dropped_system_and_question_kept():
    assert truncate_by_turns_ref(CHAT, _render, 35) == [SYS] + CHAT[3:]
    assert truncate_by_turns_ref(CHAT, _render, 34) == [SYS, CHAT[5]]
    assert truncate_by_turns_ref(CHAT, _render, 15) == [SYS, CHAT[5]]
    assert truncate_by_turns_ref(CHAT, _render, 14) is None


def test_no_system_message_and_input_unchanged():
    chat = CHAT[1:]
    before = [dict(m) for m in chat]
    assert truncate_by_turns_ref(chat, _render, 25) == [chat[2], chat[3], chat[4]]
    assert truncate_by_turns_ref(chat, _render, 4) is None
    assert chat == before
