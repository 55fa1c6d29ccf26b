"""edgellm: quantize once, run everywhere.

from edgellm import LLM, SamplingParams
llm = LLM()  # SmolLM2-135M-Instruct, torch backend
print(llm.chat([{"role": "user", "content": "Hi!"}])[0].text)
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import edgellm` (and the CLI's --help) stays fast without torch.
    if name == "LLM":
        from edgellm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from edgellm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
