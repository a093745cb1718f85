"""Stand-in drafters for the speculative-decoding tests (engine and GPU tiers): random weights
rarely repeat themselves, so these make every path of a verified step happen."""

from __future__ import annotations


class Recorded:
    """Proposes what a plain engine generated after these tokens (``wrong``: a token that is
    not it), when the tokens so far are one of its answers' beginnings."""

    def __init__(self, answers: list[list[int]], vocab_size: int, wrong: bool = False) -> None:
        self.answers, self.vocab_size, self.wrong = answers, vocab_size, wrong

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for answer in self.answers:
            if len(answer) > len(token_ids) and answer[:len(token_ids)] == token_ids:
                drafts = answer[len(token_ids):len(token_ids) + k]
                return [(t + 1) % self.vocab_size for t in drafts] if self.wrong else drafts
        return []
