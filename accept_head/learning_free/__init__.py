"""Decoders that need no draft model: Lookahead (Jacobi window + n-gram pool), N-Grammys and Ouroboros,
each verified under a tree mask by the target alone."""
