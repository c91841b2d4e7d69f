"""Reward functions of the chat tests (tests/test_chat.py, tests/test_processes.py), imported by the policy script as
`--rewards.function tests.chat_rewards:word_count` (the dataset's fields as keyword arguments, one value per response).

Each checks that the fields it is handed belong to the queries it is handed: the query, decoded, must hold the row's
`prompt` field (the very text of the question). A field that travelled with another query (a shuffle, a process, a
resume or a chunk that lost the alignment) is written to the file CHAT_ALIGNMENT_LOG names, which the tests read: the
run goes on, so that the test's assertion says what went wrong (a crash would say only that the script failed)."""

import os


def misaligned(queries: list[str], prompt: list[str]) -> list[str]:
    """The queries whose `prompt` field is not their text, logged to $CHAT_ALIGNMENT_LOG."""
    wrong = [
        f"{query!r} got {text!r}" for query, text in zip(queries, prompt, strict=True) if text.strip() not in query
    ]
    if wrong and os.environ.get("CHAT_ALIGNMENT_LOG"):
        with open(os.environ["CHAT_ALIGNMENT_LOG"], "a") as log:
            log.write("".join(line + "\n" for line in wrong))
    return wrong


def word_count(queries: list[str], responses: list[str], prompt: list[str], word: list[str]) -> list[float]:
    """How often the response says its row's `word` (the question's second word), after the alignment check."""
    misaligned(queries, prompt)
    return [float(response.split().count(w)) for response, w in zip(responses, word, strict=True)]


def ends_quickly(queries: list[str], responses: list[str], **fields) -> list[float]:
    """A gold labeler that takes every column (**fields): 1 for a response of at most 4 words, after the alignment
    check of the `prompt` field it was handed."""
    misaligned(queries, fields["prompt"])
    return [float(len(response.split()) <= 4) for response in responses]


def responses_only(responses: list[str]) -> list[float]:
    """A reward function with the wrong signature (tests/test_bad_input.py): it takes one list, not (queries,
    responses)."""
    return [1.0] * len(responses)
