"""For backend authors: tiny models, fakes, and the contract suite that proves a runtime or synthesizer right.

```python
from cartridges_sdk import testing

def test_my_runtime_keeps_the_contract():
    lm = testing.tiny_lm("llama")  # seconds to build, no files; or load_model() for the default model
    with MyRuntime.create(lm) as runtime:
        testing.check_runtime(runtime, lm)
```

Each check raises `ContractViolation` (an ``AssertionError``, so pytest shows it as a failure) whose message names
the check and what differed. The reference is always the student model's own forward pass in transformers: a
cartridge made from the first ``p`` tokens of a text must answer as that text in context does.
Importing this module imports transformers and tokenizers; the rest of the SDK never imports it.
"""

from ..errors import ContractViolation
from ..generation import Completion, GenerationParams, GenerationRequest, SynthesisRequest  # what tests build
from ..net import free_port  # tests and plugins start servers on it
from ..serve.background import serving
from .contract import (CONTRACT_TEXTS, QUESTIONS, check_composition, check_no_cross_talk, check_runtime,
                       check_runtime_exactness, check_stream, check_synthesizer, check_wrong_model_refused)
from .fakes import CHATML, LLAMA_CHAT, FakeRuntime, FakeSynthesizer, char_tokenizer, tiny_lm, tiny_model
from .isolation import (POISON, FailingContinuousRuntime, FailingRuntime, chat_answer, check_one_request_fails_alone,
                        failing)
