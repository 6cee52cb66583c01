"""tools/reproduce_table.py: the paper's τ table (families × domains) trained and evaluated under one budget."""
