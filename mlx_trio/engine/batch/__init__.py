"""The running batch and how rows get into it: solo rows, chunked and cohort prefill, `DecodeBatch`, warm-up."""
