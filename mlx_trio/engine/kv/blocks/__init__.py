"""Paged KV: full-attention KV in fixed-size blocks of one pool per model, rows as block tables (docs/design.md §6.5)."""
