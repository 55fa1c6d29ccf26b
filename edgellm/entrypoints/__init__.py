"""How people use edgellm: the `LLM` facade, the async engine, the CLI, chat and serve."""
