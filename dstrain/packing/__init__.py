"""Packing: anchor sampling, blocks of several sequences in one row, and the attention plans over them."""
