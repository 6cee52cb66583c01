"""The paper's τ table (families × domains): stages, per-run records, and the assembled report."""
