"""`tilellm bench serve`'s client-side helpers (no server needed)."""

from __future__ import annotations

import pytest

from tilellm.bench.serve import _client_share


@pytest.mark.parametrize("total,clients", [(7, 3), (2, 4), (256, 4), (5, 5), (1, 1)])
def test_client_shares_sum_to_the_total(total, clients):
    shares = [_client_share(total, clients, k) for k in range(clients)]
    assert sum(shares) == total
    assert max(shares) - min(shares) <= 1
