"""Model loaders: GGUF files and Hugging Face directories into one form."""
