"""Speculative decoding: proposers draft tokens on the host side; one target forward verifies them.

    proposer = make_proposer(config.speculative_config)
    drafts = proposer.propose(seq.token_ids, max_drafts)   # n-gram: host lists of token ids

The verification (a multi-token paged-attention step with logits at every draft position),
acceptance (`tilellm.worker.rejection`) and KV rollback (`BlockManager.trim`) live with the
parts they belong to; this package holds what proposes and what is counted.
"""

from tilellm.spec_decode.metrics import SpecDecodingStats
from tilellm.spec_decode.ngram import NgramProposer
from tilellm.spec_decode.proposer import Proposer, make_proposer

__all__ = ["NgramProposer", "Proposer", "SpecDecodingStats", "make_proposer"]
