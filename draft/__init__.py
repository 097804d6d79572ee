"""The draft (small) model: serves whole requests the router sends to the small model.

Token proposals for speculative decoding land here.
"""
