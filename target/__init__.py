"""The target (large) model: the model whose output the service promises.

Decoding (target/decoding.py), speculative verification (verify.py) and adaptive k (adaptive.py).
"""
