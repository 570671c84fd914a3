"""Drafts made by a network inside the runner's step (layer_skip: the target's first layers; draft_model).

A network can always draft, so its proposer offers the whole room: `propose` returns max_k placeholders, the
controller picks k from them as for any proposer, the scheduler reserves slots for 1 + k tokens, and the
runner's drafter (banyan/runner/drafter.py) writes the k real tokens over the placeholders before the verify
pass. Nothing here runs the network: the spec package stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from banyan.spec.proposer import Proposer

PLACEHOLDER = 0
"""The token id a draft slot holds until the runner's drafter fills it (a valid id, never verified as such)."""


class NetworkProposer(Proposer):
    def propose(self, request_id: str, token_ids: Sequence[int], max_k: int) -> list[int]:
        return [PLACEHOLDER] * max(0, max_k)
