"""The target (large) model: the model whose output the service promises.

Target-only decoding today (engines.generation). Speculative verification lands here.
"""
