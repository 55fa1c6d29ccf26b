"""Backends: each runs a forward pass over a batch whose KV lives in engine-assigned blocks.

`base.py` is the contract, `registry.py` the names `--backend` accepts.
"""
