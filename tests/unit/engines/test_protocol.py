"""TopKBatch padding: ragged rows and stacked batches, by hand."""

from __future__ import annotations

import numpy as np

from dualvllm.engines.protocol import PAD_TOKEN_ID, TopKBatch

INF = np.inf


def test_flat_rows_are_padded_to_the_width():
    batch = TopKBatch.from_flat(np.array([5, 6, 7]), np.array([-0.1, -0.2, -0.3]), np.array([2, 0, 1]), 3)
    assert batch.token_ids.tolist() == [[5, 6, -1], [-1, -1, -1], [7, -1, -1]]
    assert batch.logprobs.tolist() == [[-0.1, -0.2, -INF], [-INF, -INF, -INF], [-0.3, -INF, -INF]]
    assert batch.token_ids.dtype == np.int64 and PAD_TOKEN_ID == -1


def test_concat_keeps_the_rows_in_order_and_pads_to_the_widest():
    narrow = TopKBatch(token_ids=np.array([[1, 2]]), logprobs=np.array([[-0.5, -1.0]]))
    wide = TopKBatch(token_ids=np.array([[3, 4, -1], [5, -1, -1]]),
                     logprobs=np.array([[-0.1, -0.2, -INF], [-0.3, -INF, -INF]]))
    both = TopKBatch.concat([narrow, wide, narrow])
    assert both.token_ids.tolist() == [[1, 2, -1], [3, 4, -1], [5, -1, -1], [1, 2, -1]]
    assert both.logprobs.tolist() == [[-0.5, -1.0, -INF], [-0.1, -0.2, -INF], [-0.3, -INF, -INF],
                                      [-0.5, -1.0, -INF]]
