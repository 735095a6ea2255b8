"""benchmarks/kv_saving.py on a tiny burst: its counts follow from the block arithmetic."""

from __future__ import annotations

from benchmarks.kv_saving import main


def test_kv_saving_counts():
    # 2 clients x 64 prompt + 8 output tokens, 6 layers (5 local : 1 global), window 16.
    sliding, full = main(["--num-clients", "2", "--context-len", "64", "--output-len", "8",
                          "--window", "16", "--num-layers", "6"])
    # Full attention: one id = 6 layers; the last decode computes position 70 -> 5 blocks
    # of 16 per request.
    assert full.layers_per_block_id == 6 and full.kv_cache_groups == ["full: 6 layers"]
    assert full.decode_block_ids == 2 * 5 and full.peak_block_ids == 2 * 5
    # Windowed: 6 groups of one layer; a decode at position p reads keys p - 15 .. p: two
    # blocks per sliding group (three never: 16 keys span at most 2 blocks of 16).
    assert sliding.layers_per_block_id == 1 and len(sliding.kv_cache_groups) == 6
    assert sliding.decode_block_ids == 2 * 5 + 5 * 2 * 2
    assert sliding.decode_layer_blocks < full.decode_layer_blocks
    assert sliding.num_preemptions == full.num_preemptions == 0
