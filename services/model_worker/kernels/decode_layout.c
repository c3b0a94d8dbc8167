/* A decode step's layout in one pass over its sequences: each one's block-table row (as wide as the
 * step's longest context needs), its newest token's position, and the cache slot that token's key and
 * value go to. The same values as FlatLayout.build's torch ops, which cost a step about ten small ops
 * (and their dispatch) whatever the batch.
 *
 * rows: the persistent (num_rows, row_width) int32 block tables, one row per sequence slot;
 * seq_slots (count,): each sequence's row; context_lens (count,): its tokens after this step.
 * Outputs: table (count, width) int32, positions and slot_mapping (count,) int64.
 * Returns 0, or -1 for a row outside the tables, -2 for a context that is empty or needs more blocks
 * than `width` or a row holds, -3 for a block id in the row that is negative: nothing is read out of bounds.
 */
#include <stdint.h>
#include <string.h>

int decode_layout(const int32_t *rows, int64_t num_rows, int64_t row_width, const int64_t *seq_slots,
                  const int32_t *context_lens, int64_t count, int64_t width, int64_t block_size,
                  int32_t *table, int64_t *positions, int64_t *slot_mapping) {
    if (width < 1 || width > row_width || block_size < 1) return -2;
    for (int64_t i = 0; i < count; i++) {
        const int64_t slot = seq_slots[i];
        if (slot < 0 || slot >= num_rows) return -1;
        const int64_t context = context_lens[i];
        if (context < 1 || (context - 1) / block_size >= width) return -2;
        const int32_t *row = rows + slot * row_width;
        memcpy(table + i * width, row, (size_t)width * sizeof(int32_t));
        const int64_t position = context - 1;
        const int32_t block = row[position / block_size];
        if (block < 0) return -3;
        positions[i] = position;
        slot_mapping[i] = (int64_t)block * block_size + position % block_size;
    }
    return 0;
}
