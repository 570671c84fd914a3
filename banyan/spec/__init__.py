"""Speculative decoding: proposers draft tokens, one verifier accepts them exactly, a controller picks how many.

    proposer.py    the Proposer interface and its registry (ngram, suffix; draft_model, layer_skip later)
    ngram.py       prompt lookup: what followed the last n tokens earlier in the request
    suffix.py      suffix decoding: a depth-bounded suffix trie over this request and recent outputs
    verify.py      rejection sampling against the target's processed probabilities (torch; import it directly)
    controller.py  per request, how many drafts to verify this step
    config.py      SpeculativeConfig, vLLM's names
    speculator.py  the scheduler's handle: a proposer and a controller, drafts per step, what was accepted

Importing this package loads no torch: verify.py is imported by whoever verifies.
"""

from banyan.spec.proposer import PROPOSERS, Proposer, make_proposer

__all__ = ["PROPOSERS", "Proposer", "make_proposer"]
