"""`PinnedStaging`: a step's host arrays, packed into one buffer and copied at once, come out as
device views equal to them, in the order they were added, whatever their dtypes and sizes, also
when the buffer grows in the middle of a step (on the CPU the buffer is not pinned)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tilellm.worker.staging import PinnedStaging

DTYPES = [np.int64, np.int32, np.float32, np.bool_]


def _array(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    if dtype is np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(-1000, 1000, shape).astype(dtype)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.integers(0, 37), st.sampled_from([0, 1, 3])),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 2**16),
)
def test_commit_gives_each_array_back(items, seed):
    rng = np.random.default_rng(seed)
    staging = PinnedStaging(torch.device("cpu"), nbytes=100)  # small: most steps grow it
    for _ in range(2):  # a second step reuses the buffer
        arrays = [_array(rng, dtype, (n,) if cols == 0 else (n, cols)) for dtype, n, cols in items]
        indices = []
        for i, a in enumerate(arrays):
            if i % 2:  # written in place through `reserve`
                index, view = staging.reserve(a.shape, a.dtype)
                view[...] = a
            else:
                index = staging.add(a)
            indices.append(index)
        assert indices == list(range(len(arrays)))
        views = staging.commit()
        for a, t in zip(arrays, views):
            assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
            assert t.numpy().tolist() == a.tolist()


def test_discard_forgets_what_a_failed_step_added():
    staging = PinnedStaging(torch.device("cpu"), nbytes=64)
    staging.add(np.arange(100, dtype=np.int64))  # (grows the buffer)
    staging.discard()
    assert staging.add(np.array([7, 8, 9], dtype=np.int32)) == 0
    (view,) = staging.commit()
    assert view.tolist() == [7, 8, 9]
