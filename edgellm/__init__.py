"""edgellm: quantize once, run everywhere.

from edgellm import LLM, SamplingParams
llm = LLM()  # SmolLM2-135M-Instruct on the best backend this machine has
print(llm.chat([{"role": "user", "content": "Hi!"}])[0].text)
"""

# the public API, re-exported; the packages below depend one way (see README, Architecture)
from edgellm.entrypoints.llm import LLM
from edgellm.sampling.params import SamplingParams
from edgellm.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]
