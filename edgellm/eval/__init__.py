"""Measuring models: perplexity, model info and the load generator behind `edgellm bench`."""
