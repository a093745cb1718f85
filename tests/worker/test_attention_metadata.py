"""AttentionMetadata's per-step helpers: what the attention backends read from one step's metadata."""

import torch

from nvray.layers.attention import AttentionMetadata


def _meta(seq_lens: list[int]) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int32), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.zeros(n, 8, dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens), query_lens_cpu=[1] * n, seq_lens_cpu=seq_lens)


def test_decode_order_is_every_sequence_longest_first_once_per_step():
    seq_lens = [5, 100, 30, 100, 0, 64]
    meta = _meta(seq_lens)
    order = meta.decode_order()
    assert order.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(len(seq_lens)))  # a permutation of the rows
    lens_in_order = [seq_lens[i] for i in order.tolist()]
    assert lens_in_order == sorted(seq_lens, reverse=True)
    assert meta.decode_order() is order  # every layer of the step reads the same tensor


def test_cu_seqlens_k_counts_each_context():
    meta = _meta([3, 0, 7])
    assert meta.cu_seqlens_k().tolist() == [0, 3, 3, 10]
