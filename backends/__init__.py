"""Backends: each runs a forward pass over a batch whose KV lives in engine-assigned blocks."""
